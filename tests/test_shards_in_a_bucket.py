"""Training from tar shards in an S3 bucket, served by moto's server on loopback and read by
the real client (s3fs, botocore): a run stopped by SIGTERM and resumed ends bit-identical to
one never interrupted; a store that goes away mid-run ends the run in one line with the
command that finishes it, and that command, through connections that drop mid-shard,
finishes it bit-identical; credentials and buckets that are wrong stop a run before step 1.
The set-up is in bench/lib/s3_loopback.py and the fixtures in tests/conftest.py."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from bench.lib.s3_loopback import S3Bucket, client_environment
from conftest import REPO_ROOT, clip_shard
from taehv_train.common.annotation_file import read_annotation
from train_runs import (
    ONE_PROCESS,
    assert_identical,
    exit_status,
    one_line_error,
    start,
    train,
    train_args,
    wait_for,
)

STEPS = 10
# checkpoints only where a run stops or ends (the ones resumed and compared); one loader worker that keeps
# few batches ahead, so that a store gone at step 3 is missed before step 10
COMMON = (
    "--run_name=run",
    f"--max_train_steps={STEPS}",
    f"--checkpointing_steps={STEPS}",
    "--validation_every=5",
    "--dataloader_num_workers=1",
    "--prefetch_factor=1",
    "--prefetch_batches=1",
)


def shard_bytes(files: dict[Path, int], prefix: str) -> bytes:
    """A tar shard of ``files`` (path -> frame count), each clip's JSON stating its frames."""
    return clip_shard(
        [(f"{prefix}{i:04d}{p.suffix}", p.read_bytes(), {"frames": n}) for i, (p, n) in enumerate(files.items())]
    )


@pytest.fixture(scope="module")
def bucket(s3_server, demo_clips, tmp_path_factory) -> dict:
    """The demo clips as shards in a bucket (training: two shards, validation: one), the
    client environment of the runs (this module's own index cache) and an uninterrupted run."""
    home = tmp_path_factory.mktemp("bucket-client")
    env = client_environment(s3_server.endpoint, home) | {"TAEHV_SHARD_INDEX_CACHE": str(home / "index")}
    store = S3Bucket(s3_server, "clips", env)
    root = Path(demo_clips["root"])
    train_clips = {root / e["path"]: e["frames"] for e in read_annotation(demo_clips["train"])["list"]}
    val_clips = {root / e["path"]: e["frames"] for e in read_annotation(demo_clips["val"])["list"]}
    halves = [dict(list(train_clips.items())[:3]), dict(list(train_clips.items())[3:])]
    for n, half in enumerate(halves):
        store.put(f"shards/train/{n:05d}.tar", shard_bytes(half, f"t{n}"))
    store.put("shards/val/00000.tar", shard_bytes(val_clips, "v"))
    data = {"root": "", "train": store.url("shards/train/*.tar"), "val": store.url("shards/val/{00000..00000}.tar")}
    full = tmp_path_factory.mktemp("full")
    train(ONE_PROCESS, full, data, *COMMON, env=env)
    return {"data": data, "env": env, "store": store, "full": full / "run"}


def assert_same_run(full: Path, resumed: Path) -> None:
    assert_identical(full / "final_model.safetensors", resumed / "final_model.safetensors")
    last = f"checkpoints/checkpoint-{STEPS}"
    for name in sorted(p.name for p in (full / last).glob("*.safetensors")):
        assert_identical(full / last / name, resumed / last / name)


@pytest.mark.slow  # three short training runs from the bucket (the uninterrupted one in the fixture)
def test_a_run_from_a_bucket_stopped_by_sigterm_resumes_bit_identical(bucket, tmp_path):
    train(ONE_PROCESS, tmp_path, bucket["data"], *COMMON, "--fault_injection=sigterm@4", env=bucket["env"])
    assert "stopped on" in (tmp_path / "run" / "train.log").read_text()
    train(ONE_PROCESS, tmp_path, bucket["data"], *COMMON, "--resume=latest", env=bucket["env"])
    assert_same_run(bucket["full"], tmp_path / "run")
    full_log = (bucket["full"] / "validation_history.json").read_text()
    assert full_log == (tmp_path / "run" / "validation_history.json").read_text()
    assert len(json.loads(full_log)) == 2


@pytest.mark.slow  # two short training runs through a proxy that fails
def test_a_store_gone_mid_run_ends_in_one_line_whose_command_finishes_the_run_through_dropped_connections(
    bucket, s3_proxy, tmp_path
):
    env = bucket["env"] | {"AWS_ENDPOINT_URL": s3_proxy.endpoint}
    s3_proxy.drop_responses(0, 0)
    s3_proxy.go_up()
    out, log = tmp_path / "out", tmp_path / "gone.log"
    retries = ("--shard_read_attempts=2", "--shard_retry_wait_s=0.02")
    process = start(train_args(ONE_PROCESS, out, bucket["data"], *COMMON, *retries), log, env=env)
    wait_for(lambda: log.exists() and "step 3:" in log.read_text(), what="step 3")
    s3_proxy.go_down()
    assert exit_status(process, timeout=240) == 2, log.read_text()[-3000:]
    output = log.read_text()
    assert "Traceback" not in output
    line = next(line for line in output.splitlines() if "error: " in line)
    assert "unusable" in line and "resume with: " in line, line
    assert "shard unreachable" in output  # each clip's skip, counted and logged

    s3_proxy.go_up()
    # the next response is cut after 1000 bytes of its body: its read's second attempt gets the bytes (a
    # read that failed both would replace its clip, and the run would no longer be the same run)
    s3_proxy.drop_responses(1, 1000)
    resume = shlex.split(line.split("resume with: ")[1])
    # this process's environment too (its thread count: CPU gradients depend on it, so a run resumed with
    # other threads than it started with is not bit-identical)
    env = {**os.environ, **env}
    finished = subprocess.run(resume, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=env)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "retry 1 of 1" in (out / "run" / "train.log").read_text()
    assert_same_run(bucket["full"], out / "run")
    s3_proxy.go_down()


@pytest.mark.slow  # three starts that stop in pre-flight (~8 s each)
def test_wrong_keys_a_missing_bucket_and_an_empty_pattern_stop_before_step_1_in_one_line(
    bucket, s3_auth_server, tmp_path
):
    made_up = {"AWS_ACCESS_KEY_ID": "made-up", "AWS_SECRET_ACCESS_KEY": "made-up"}
    cases = {
        "(credentials)": (
            bucket["env"] | client_environment(s3_auth_server.endpoint, tmp_path, made_up),
            bucket["data"],
        ),
        "(no bucket)": (bucket["env"], bucket["data"] | {"train": "s3://no-such-bucket/shards/*.tar"}),
        "matches no shard": (bucket["env"], bucket["data"] | {"train": bucket["store"].url("other/*.tar")}),
    }
    for said, (env, data) in cases.items():
        out = tmp_path / "".join(c for c in said if c.isalpha())
        result = train(ONE_PROCESS, out, data, *COMMON, env=env, expect=2)
        one_line_error(result)  # exit 2, no traceback: "error: invalid config: ..." (a line per key naming shards)
        assert said in result.stderr, result.stderr
        assert not out.exists()  # before any run folder
