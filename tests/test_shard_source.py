"""Where shards are and how their bytes are read (common/shard_source.py): shard lists spelled
as WebDataset spells them, exact byte ranges from local disk and from a real S3 API (moto's
server on loopback, bench/lib/s3_loopback.py), each fault named by its kind, transient ones retried
through a proxy that really drops connections, and the one-line checks before a run."""

from __future__ import annotations

import logging
import multiprocessing
import subprocess
import sys

import pytest

from taehv_train.common.shard_source import (
    RetryPolicy,
    ShardReadError,
    expand_shards,
    is_shard_source,
    read_range,
    shard_stat,
    source_errors,
)

DATA = bytes(range(256)) * 16  # 4 KiB, every offset distinguishable from its neighbours
QUICK = RetryPolicy(attempts=3, first_wait_s=0.01, max_wait_s=1.0)  # the retries, without the waits


def fault_kind(url: str, start: int = 0, size: int = 16) -> str:
    with pytest.raises(ShardReadError) as raised:
        read_range(url, start, size, retry=QUICK)
    assert url in raised.value.detail and "\n" not in raised.value.detail
    return raised.value.kind


@pytest.mark.parametrize(
    ("value", "shards"),
    [
        ("clips/00000.tar", True),
        ("clips/{00000..00009}.tar", True),
        ("a.tar::b.tar", True),
        (["s3://bucket/clips/00000.tar", "s3://bucket/clips/00001.tar"], True),
        ("s3://bucket/clips/*.tar", True),
        ("https://host/clips/00000.tar?X-Amz-Signature=abc", True),
        ("clips", False),
        ("clips/", False),
        ("annotations.json", False),
        ("s3://bucket/clips/", False),
        ("", False),
    ],
)
def test_is_shard_source_tells_shards_from_folders_and_annotation_files(value, shards):
    assert is_shard_source(value) is shards


def test_lists_double_colons_and_braces_expand_in_order_each_shard_once():
    assert expand_shards(["b.tar", "a.tar", "b.tar"]) == ["b.tar", "a.tar"]
    assert expand_shards("b.tar::a.tar") == ["b.tar", "a.tar"]
    assert expand_shards("s/{00008..00010}.tar") == ["s/00008.tar", "s/00009.tar", "s/00010.tar"]
    assert expand_shards(["s3://b/{1,0}.tar", "s3://b/1.tar"]) == ["s3://b/1.tar", "s3://b/0.tar"]


def test_a_local_glob_matches_sorted_within_the_glob_and_keeps_the_list_order(tmp_path):
    for name in ("c.tar", "a.tar", "b.tar", "a.json"):
        (tmp_path / name).write_bytes(DATA)
    found = expand_shards([str(tmp_path / "c.tar"), str(tmp_path / "*.tar")])
    assert found == [str(tmp_path / name) for name in ("c.tar", "a.tar", "b.tar")]
    assert expand_shards(str(tmp_path / "[ab].tar")) == [str(tmp_path / "a.tar"), str(tmp_path / "b.tar")]


def test_an_s3_glob_matches_the_buckets_shards_sorted(s3_bucket):
    for key in ("s/b.tar", "s/a.tar", "s/a.json", "t/c.tar"):
        s3_bucket.put(key, DATA)
    assert expand_shards(s3_bucket.url("s/*.tar")) == [s3_bucket.url("s/a.tar"), s3_bucket.url("s/b.tar")]
    assert expand_shards(s3_bucket.url("?/*.tar")) == [s3_bucket.url(k) for k in ("s/a.tar", "s/b.tar", "t/c.tar")]


def test_read_range_returns_exactly_the_bytes_asked_for_from_disk_and_from_s3(tmp_path, s3_bucket):
    local = tmp_path / "00000.tar"
    local.write_bytes(DATA)
    for url in (str(local), local.as_uri(), s3_bucket.put("00000.tar", DATA)):
        assert read_range(url, 1000, 300) == DATA[1000:1300]
        assert read_range(url, 0, len(DATA)) == DATA
        assert read_range(url, 5, 0) == b""
        size, version = shard_stat(url)
        assert size == len(DATA) and version


def test_each_permanent_fault_of_a_store_is_named_by_its_kind(tmp_path, s3_bucket):
    url = s3_bucket.put("00000.tar", DATA)
    assert fault_kind(s3_bucket.url("00001.tar")) == "missing"
    assert fault_kind("s3://no-such-bucket-here/00000.tar") == "no bucket"
    assert fault_kind(url, len(DATA) - 8, 16) == "truncated"  # the range runs past the end
    assert fault_kind(url, len(DATA) + 100, 16) == "truncated"  # the range starts past it
    assert fault_kind(str(tmp_path / "none.tar")) == "missing"
    short = tmp_path / "short.tar"
    short.write_bytes(DATA[:100])
    assert fault_kind(str(short), 90, 16) == "truncated"


def test_wrong_keys_are_refused_by_the_store_and_named_credentials(s3_bucket, s3_auth_server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_auth_server.endpoint)
    assert fault_kind(s3_bucket.url("00000.tar")) == "credentials"
    line = source_errors(s3_bucket.url("*.tar"))
    assert len(line) == 1 and "credentials" in line[0] and "InvalidAccessKeyId 403" in line[0]
    assert "botocore took from env" in line[0]


def test_no_credentials_anywhere_is_named_credentials(s3_bucket, monkeypatch):
    url = s3_bucket.put("00000.tar", DATA)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert fault_kind(url) == "credentials"
    (line,) = source_errors(url)
    assert line.startswith("no AWS credentials for the s3:// shards: botocore looked at AWS_ACCESS_KEY_ID")
    assert s3_bucket.environment["AWS_SHARED_CREDENTIALS_FILE"] in line


def test_responses_cut_mid_shard_fewer_times_than_the_attempts_are_retried_until_the_bytes_arrive(
    s3_bucket, s3_through_proxy, caplog
):
    url = s3_bucket.put("00000.tar", DATA)
    s3_through_proxy.drop_responses(QUICK.attempts - 1, after_body_bytes=1000)
    with caplog.at_level(logging.WARNING, logger="taehv_train.common.shard_source"):
        assert read_range(url, 0, len(DATA), retry=QUICK) == DATA
    assert s3_through_proxy.dropped == QUICK.attempts - 1
    retries = [record.getMessage() for record in caplog.records]
    assert len(retries) == QUICK.attempts - 1
    assert all(url in message and "1000 of 4096 bytes" in message for message in retries)


def test_responses_cut_as_often_as_the_attempts_end_as_unreachable(s3_bucket, s3_through_proxy):
    url = s3_bucket.put("00000.tar", DATA)
    s3_through_proxy.drop_responses(QUICK.attempts, after_body_bytes=1000)
    assert fault_kind(url, 0, len(DATA)) == "unreachable"
    assert s3_through_proxy.dropped == QUICK.attempts


def test_a_store_that_refuses_connections_is_unreachable(s3_bucket, s3_through_proxy):
    url = s3_bucket.put("00000.tar", DATA)
    assert read_range(url, 0, 4) == DATA[:4]  # a pooled connection, which going down ends
    s3_through_proxy.go_down()
    assert fault_kind(url) == "unreachable"
    (line,) = source_errors(url, retry=QUICK)
    assert line.startswith(f"shard source cannot be read (unreachable), first: {s3_bucket.url('*.tar')}")


def test_source_errors_say_each_cause_once_in_one_line(tmp_path, s3_bucket):
    s3_bucket.put("s/00000.tar", DATA)
    (tmp_path / "00000.tar").write_bytes(DATA)
    assert source_errors(s3_bucket.url("s/*.tar")) == []
    assert source_errors([str(tmp_path / "00000.tar"), s3_bucket.url("s/00000.tar")]) == []
    lines = source_errors(
        [
            str(tmp_path / "0000{0..3}.tar"),  # three of these four are missing
            s3_bucket.url("s/0000{0..2}.tar"),  # two missing in the bucket
            s3_bucket.url("none/*.tar"),
            "s3://no-such-bucket-here/*.tar",
            "s3://no-such-bucket-either/00000.tar",
            str(tmp_path / "clips.json"),
        ]
    )
    assert all("\n" not in line for line in lines)
    assert len(lines) == 4, lines
    not_shards, unmatched, no_bucket, missing = lines
    assert not_shards.startswith(f"1 entry of the shard list is not a .tar shard, first: {tmp_path / 'clips.json'}")
    assert unmatched.startswith(f"the shard pattern matches no shard, first: {s3_bucket.url('none/*.tar')}")
    assert no_bucket.startswith("2 shard sources cannot be read (no bucket), first: s3://no-such-bucket-here")
    assert missing.startswith(f"5 shard sources cannot be read (missing), first: {tmp_path / '00001.tar'}")


def test_s3_shards_without_s3fs_installed_say_how_to_install_it(tmp_path):
    hidden = "import sys; sys.modules['s3fs'] = None"  # what Python does for a package not there
    check = "from taehv_train.common.shard_source import source_errors; print(source_errors('s3://b/s/*.tar'))"
    done = subprocess.run([sys.executable, "-c", f"{hidden}; {check}"], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ("['s3:// shards are read through s3fs, which is not installed: pip install s3fs']")


def _read_in_child(url: str, results) -> None:
    results.put(read_range(url, 100, 50))


def test_a_forked_worker_reads_with_a_filesystem_of_its_own(s3_bucket):
    url = s3_bucket.put("00000.tar", DATA)
    assert read_range(url, 0, 4) == DATA[:4]  # the parent's filesystem, its event loop running
    fork = multiprocessing.get_context("fork")  # as a DataLoader worker starts on Linux
    results = fork.Queue()
    child = fork.Process(target=_read_in_child, args=(url, results))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert results.get(timeout=5) == DATA[100:150]
