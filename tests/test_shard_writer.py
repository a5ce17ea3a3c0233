"""make_annotations --to_shards: WebDataset tar shards with sidecar indexes, train and val
apart, incremental, many machines without collisions, every refusal one line."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import webdataset
from test_make_annotations import documented_command

from conftest import REPO_ROOT, tool_exit
from taehv_train.common import shard_writer
from taehv_train.common.shard_index import index_from_text, sidecar_url
from taehv_train.common.shard_writer import clip_key, parse_size
from taehv_train.training import make_annotations

SHARD_SIZE = "10KiB"  # two of the tiny clips per shard (a tar is a multiple of 10 KiB records)
SPLIT = ["--val_fraction", "0.25", "--group_regex", ""]


@pytest.fixture(scope="module")
def tiny_videos(tmp_path_factory) -> Path:
    """Eight 16x16 clips of 4 frames (under 2 KiB each)."""
    from taehv_train.training.demo_data import make_demo_dataset

    root = tmp_path_factory.mktemp("tiny_videos")
    make_demo_dataset(root, num_clips=8, n_frames=4, height=16, width=16, seed=3)
    return root / "videos"


@pytest.fixture
def folder(tiny_videos, tmp_path) -> Path:
    """A copy of the tiny clips that a test may add to."""
    return Path(shutil.copytree(tiny_videos, tmp_path / "videos"))


def run(capsys, *args: str) -> tuple[int, str, list[str]]:
    """The tool as ``python -m taehv_train.training.make_annotations`` runs it."""
    return tool_exit(capsys, make_annotations._exit_with_status, *args)


def sidecars(side: Path) -> dict[str, list]:
    """Shard name -> its index's members, for every finished shard in ``side``."""
    return {
        tar.name: list(index_from_text(str(tar), Path(sidecar_url(str(tar))).read_text()).members)
        for tar in sorted(side.glob("*.tar"))
        if Path(sidecar_url(str(tar))).exists()
    }


def packed_paths(out: Path) -> list[str]:
    return sorted(m.path for side in ("train", "val") for members in sidecars(out / side).values() for m in members)


def annotated(out: Path, side: str, stem: str = "annotations") -> dict[str, dict]:
    return {e["path"]: e for e in json.loads((out / f"{stem}_{side}.json").read_text())["list"]}


def test_shards_hold_each_clip_as_its_file_and_probe_in_the_webdataset_layout(folder, tmp_path, capsys):
    out = tmp_path / "shards"
    status, stdout, _ = run(capsys, str(folder), "--to_shards", str(out), "--shard_size", SHARD_SIZE, *SPLIT)
    assert status == 0
    for side in ("train", "val"):
        entries = annotated(out, side)  # -o defaults to OUT/annotations.json
        shards = sidecars(out / side)
        assert sorted(m.path for members in shards.values() for m in members) == sorted(entries)
        assert len(list((out / side).glob("*.tar"))) == len(shards)  # every shard finished
        for name, members in shards.items():
            data = (out / side / name).read_bytes()
            index = index_from_text(name, (out / side / f"{name}.index.json").read_text())
            assert index.shard_bytes == len(data)
            assert len(data) <= parse_size(SHARD_SIZE)
            for member in members:
                clip = (folder / member.path).read_bytes()
                assert data[member.offset : member.offset + member.size] == clip
                assert member.name == f"{clip_key(member.path)}.mp4" and "." not in member.key
                entry = entries[member.path]
                assert (member.frames, member.width, member.height, member.fps) == (4, 16, 16, entry["fps"])
        # The format check: WebDataset reads the same samples, keys, JSON and bytes.
        urls = [str(out / side / name) for name in shards]
        samples = list(webdataset.WebDataset(urls, shardshuffle=False))
        assert [s["__key__"] for s in samples] == [m.key for members in shards.values() for m in members]
        for sample in samples:
            meta = json.loads(sample["json"])
            entry = entries[meta["path"]]
            assert meta == {"key": sample["__key__"], **{k: v for k, v in entry.items() if k != "full_path"}}
            assert sample["mp4"] == (folder / meta["path"]).read_bytes()
    assert len(sidecars(out / "train")) == 3 and len(sidecars(out / "val")) == 1  # 6 and 2 clips, two a shard
    assert f"'--data_root={out}/train/*.tar' --annotation_file= '--val_annotation_file={out}/val/*.tar'" in stdout
    assert "train: packed 6 clips into 3 new shards" in stdout and "val: packed 2 clips into 1 new shard" in stdout


def test_a_clip_larger_than_the_shard_size_gets_a_shard_of_its_own(folder, tmp_path, capsys):
    out = tmp_path / "shards"
    assert run(capsys, str(folder), "--to_shards", str(out), "--shard_size", "1", "--val_fraction", "0")[0] == 0
    assert [len(members) for members in sidecars(out / "train").values()] == [1] * 8


def test_a_rerun_packs_only_new_clips_and_rewrites_an_unfinished_shard(folder, tmp_path, capsys):
    out = tmp_path / "shards"
    args = [str(folder), "--to_shards", str(out), "--shard_size", SHARD_SIZE, *SPLIT]
    assert run(capsys, *args)[0] == 0
    before = {p.name: p.read_bytes() for p in (out / "train").iterdir()}

    shutil.copy(folder / "clip_00000.mp4", folder / "zz_new.mp4")
    status, stdout, _ = run(capsys, *args)
    assert status == 0 and "probed 1 new or changed files, reused 8" in stdout
    shards = sidecars(out / "train") | sidecars(out / "val")
    new = [name for name in shards if name not in before]
    assert [m.path for m in shards[new[0]]] == ["zz_new.mp4"] and len(new) == 1
    assert all((out / "train" / name).read_bytes() == data for name, data in before.items())

    # A killed run: a shard without its sidecar, a temporary file; both go, their clips are packed again.
    (out / "train" / "00001.tar.index.json").unlink()
    (out / "train" / ".tmp-00009.tar").write_bytes(b"cut off")
    status, stdout, _ = run(capsys, *args)
    assert status == 0
    names = sorted(p.name for p in (out / "train").glob("*.tar")) + sorted(p.name for p in (out / "train").glob(".*"))
    assert "00001.tar" not in names and ".tmp-00009.tar" not in names
    assert packed_paths(out) == sorted([*(p.name for p in folder.iterdir())])  # each clip once
    assert "train: packed 2 clips into 1 new shard" in stdout
    assert (
        f"removed 2 unfinished shards (no index: a stopped run's), their clips packed again: {out}/train/.tmp-"
        in stdout
    )


def stop_in_the_second_shard(monkeypatch) -> None:
    """Make the tool stop (as Ctrl+C does) in the middle of writing its second shard."""
    real, calls = shard_writer.write_tar, []

    def stopped_in_the_second_shard(f, clips, url):
        calls.append(url)
        if len(calls) == 2:
            f.write(b"\0" * 700)  # some of the shard is out
            raise KeyboardInterrupt
        return real(f, clips, url)

    monkeypatch.setattr(shard_writer, "write_tar", stopped_in_the_second_shard)


def test_an_interrupted_pack_leaves_only_finished_shards(folder, tmp_path, capsys, monkeypatch):
    out = tmp_path / "shards"
    args = [str(folder), "--to_shards", str(out), "--shard_size", SHARD_SIZE, "--val_fraction", "0"]
    stop_in_the_second_shard(monkeypatch)
    status, _, stderr = run(capsys, *args)
    assert status == make_annotations.EXIT_INTERRUPTED and "the same command continues" in stderr[-1]
    assert sorted(p.name for p in (out / "train").iterdir()) == ["00000.tar", "00000.tar.index.json"]

    monkeypatch.undo()  # the tool as it is
    status, stdout, _ = run(capsys, *args)
    assert status == 0 and "train: packed 6 clips into 3 new shards" in stdout
    assert packed_paths(out) == sorted(p.name for p in folder.iterdir())


def test_parts_pack_in_parallel_under_their_own_names_with_each_source_in_one_part(folder, tmp_path, capsys):
    for source in ("cam", "dash", "drone", "phone", "bike"):  # sources by the default --group_regex, as clip_*
        for i in range(2):
            shutil.copy(folder / f"clip_0000{i}.mp4", folder / f"{source}_{i}.mp4")
    out = tmp_path / "shards"
    for k in (1, 2):
        args = ["--to_shards", str(out), "--shard", f"{k}/2", "--shard_size", SHARD_SIZE, "--val_fraction", "0.3"]
        status, stdout, _ = run(capsys, str(folder), *args)
        assert status == 0 and f"shard {k}/2:" in stdout and "once all 2 parts are packed, train on them" in stdout
    parts: dict[str, set[str]] = {}  # source -> the parts and sides its clips were packed in
    for side in ("train", "val"):
        for name, members in sidecars(out / side).items():
            assert name.startswith(("part-1-of-2-", "part-2-of-2-"))
            for member in members:
                parts.setdefault(member.path.split("_")[0], set()).add(f"{name[:12]} {side}")
    assert all(len(where) == 1 for where in parts.values()), parts  # a source is in one part, on one side
    assert {where.pop()[:12] for where in parts.values()} == {"part-1-of-2-", "part-2-of-2-"}
    assert packed_paths(out) == sorted(p.name for p in folder.iterdir())  # the union has every clip once
    assert (out / "annotations_part-1-of-2_train.json").exists() and (
        out / "annotations_part-2-of-2_train.json"
    ).exists()


def test_shards_go_to_an_fsspec_url(folder, tmp_path, capsys):
    url = "memory://bucket/shards"
    args = [str(folder), "--to_shards", url, "-o", str(tmp_path / "ann.json"), "--shard_size", SHARD_SIZE, *SPLIT]
    status, stdout, _ = run(capsys, *args)
    assert status == 0 and f"'--data_root={url}/train/*.tar'" in stdout
    fs = fsspec.filesystem("memory")
    names = sorted(Path(p).name for p in fs.ls("/bucket/shards/train", detail=False))
    assert names == [
        "00000.tar",
        "00000.tar.index.json",
        "00001.tar",
        "00001.tar.index.json",
        "00002.tar",
        "00002.tar.index.json",
    ]
    index = index_from_text("00002.tar", fs.cat_file("/bucket/shards/train/00002.tar.index.json").decode())
    data = fs.cat_file("/bucket/shards/train/00002.tar")
    for member in index.members:
        assert data[member.offset : member.offset + member.size] == (folder / member.path).read_bytes()
    fs.rm("/bucket", recursive=True)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shard_size", "1XB"], "--shard_size '1XB': expected a size such as 1GB"),
        (["--shard_size", "0"], "--shard_size '0': expected"),
        (["--merge"], "--to_shards packs each --shard part on its own: there is nothing to --merge"),
    ],
)
def test_packing_refuses_a_mistake_in_one_line_before_probing(folder, tmp_path, capsys, args, message):
    out = tmp_path / "shards"
    status, stdout, stderr = run(capsys, str(folder), "--to_shards", str(out), *args)
    assert status == 2 and len(stderr) == 1 and stderr[0].startswith(f"error: {message}")
    assert stdout == "" and not (out / "annotations_probes.jsonl").exists()


def test_packing_refuses_a_size_without_out_an_out_it_cannot_write_and_a_url_without_a_local_o(
    folder, tmp_path, capsys
):
    status, _, stderr = run(capsys, str(folder), "-o", str(tmp_path / "a.json"), "--shard_size", "1GB")
    assert status == 2 and stderr == ["error: --shard_size goes with --to_shards OUT: name where the shards go"]
    (tmp_path / "file").write_text("")
    status, _, stderr = run(capsys, str(folder), "--to_shards", str(tmp_path / "file" / "shards"))
    assert status == 2 and stderr == [f"error: --to_shards {tmp_path}/file/shards: cannot write there: Not a directory"]
    status, _, stderr = run(capsys, str(folder), "--to_shards", "memory://bucket/x")
    assert status == 2 and stderr == [
        "error: --to_shards memory://bucket/x: name a local -o for the annotation and probe files"
    ]


def test_shard_sizes_in_decimal_and_binary_units():
    assert [parse_size(t) for t in ("1GB", "500MB", "1GiB", "4096", "1.5KB", "2 mib")] == [
        10**9,
        5 * 10**8,
        2**30,
        4096,
        1500,
        2 * 2**20,
    ]


@pytest.mark.slow  # processes of the tool, as the docs run it
def test_the_documented_packing_commands_run_from_any_folder(folder, tmp_path):
    """docs/data.md's local packing command and its Slurm array job of parts (its bucket a
    local folder here), run from a folder that is not the repository."""
    for i, clip in enumerate(sorted(folder.iterdir())):  # eight sources of one clip each
        clip.rename(folder / f"{'abcdefgh'[i]}_0.mp4")
    shards, parts = tmp_path / "shards", tmp_path / "parts"

    def run(command: str, **env: str) -> subprocess.CompletedProcess:
        for doc, here in (
            ("/path/to/taehv-train", REPO_ROOT),
            ("/data/videos", folder),
            ("/data/shards", shards),
            ("s3://bucket/clips", parts),
            ("/data/annotations.json", tmp_path / "annotations.json"),
        ):
            command = command.replace(doc, str(here))
        command = re.sub(r"^python ", f"{sys.executable} ", command)  # the docs' python: the project's
        return subprocess.run(
            ["bash", "-c", command],
            cwd=tmp_path,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )

    local = run(documented_command(r"^(python -m taehv_train\.training\.make_annotations \S+ --to_shards [^\n]*)$"))
    assert local.returncode == 0, local.stderr
    assert f"'--data_root={shards}/train/*.tar'" in local.stdout and (shards / "annotations_train.json").exists()

    script = documented_command(r"```bash\n(#!/bin/bash\n#SBATCH --job-name=pack\n.*?)```")
    for task in (1, 2):
        job = run(script, SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_TASK_COUNT="2", SLURM_CPUS_PER_TASK="1")
        assert job.returncode == 1, job.stderr  # 5 and 3 sources: --val_fraction 0.1 holds none out; packed anyway
        assert "the validation file is empty" in job.stderr and f"shard {task}/2: " in job.stdout
        assert (tmp_path / f"annotations_part-{task}-of-2_probes.jsonl").exists()
    assert packed_paths(parts) == packed_paths(shards) == sorted(p.name for p in folder.iterdir())


@pytest.mark.slow  # a process of the tool against the S3 server
def test_shards_go_to_an_s3_bucket_and_an_interrupted_upload_leaves_no_object(
    s3_bucket, folder, tmp_path, capsys, monkeypatch
):
    bucket = s3_bucket.name
    args = ["--to_shards", f"s3://{bucket}/clips", "-o", str(tmp_path / "a.json"), "--shard_size", SHARD_SIZE, *SPLIT]
    # as the docs say: the store from AWS_ENDPOINT_URL (set by the fixture), which botocore reads
    tool = [sys.executable, "-m", "taehv_train.training.make_annotations", str(folder), *args]
    result = subprocess.run(tool, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    assert sorted(Path(p).name for p in fs.ls(f"{bucket}/clips/train")) == [
        f"0000{i}.tar{tail}" for i in range(3) for tail in ("", ".index.json")
    ]
    index = index_from_text("00001.tar", fs.cat_file(f"{bucket}/clips/train/00001.tar.index.json").decode())
    for member in index.members:  # one byte-range request per clip
        data = fs.cat_file(f"{bucket}/clips/train/00001.tar", start=member.offset, end=member.offset + member.size)
        assert data == (folder / member.path).read_bytes()

    stop_in_the_second_shard(monkeypatch)
    stopped = ["--to_shards", f"s3://{bucket}/stopped", "-o", str(tmp_path / "c.json"), "--shard_size", SHARD_SIZE]
    status, _, stderr = run(capsys, str(folder), *stopped, "--val_fraction", "0")
    assert status == make_annotations.EXIT_INTERRUPTED, stderr
    assert sorted(Path(p).name for p in fs.ls(f"{bucket}/stopped/train", refresh=True)) == [
        "00000.tar",
        "00000.tar.index.json",
    ]

    status, stdout, stderr = run(capsys, str(folder), "--to_shards", "s3://no-such-bucket/clips", "-o", "b.json")
    assert status == 2 and stdout == "" and stderr[0].startswith("error: --to_shards s3://no-such-bucket/clips: cannot")
    assert len(stderr) == 1, stderr  # before probing
