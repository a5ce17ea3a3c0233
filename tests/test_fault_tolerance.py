"""Fault tolerance of real training processes: exact resume, SIGTERM, crash during save,
kill -9, non-finite and out-of-memory steps agreed across ranks, early stopping.

The exactness chains interrupt a run twice and resume it twice; the result must be
bit-identical to an uninterrupted run. One (2-process ZeRO-2) is stopped by an injected
SIGTERM, then crashes while a later checkpoint is being written, with faults injected at
fixed windows in both runs (an out-of-memory forward on one rank, a NaN loss on the other),
so it also shows that skipped steps are skipped identically on every rank and after a
resume. The other (1 process, and 2-process ZeRO-2 through the launch script) is stopped
by real SIGTERMs as schedulers send them, during decoder-only fine-tuning. Each scenario
checks several behaviours in one chain, so that the suite starts as few training processes
as it can.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import REPO_ROOT
from taehv_train.base.atomic import TMP_PREFIX
from taehv_train.common.run_files import CHECKPOINT_MANIFEST
from taehv_train.training.state.run_folders import checkpoint_step, list_checkpoints
from taehv_train.training.state.run_lock import lock_run_dir, release_run_dir
from train_runs import (
    DDP_ENV,
    ONE_PROCESS,
    all_ended,
    assert_identical,
    child_running,
    ddp,
    deepspeed_zero2,
    exit_status,
    kill_session,
    one_line_error,
    processes_of,
    rank_pid,
    refused_here,
    start,
    tensors,
    train,
    train_args,
    train_here,
    wait_for,
    wrapped_ddp,
)

pytestmark = pytest.mark.slow  # training processes

STEPS = 6
FAULTS = "oom@2:1,nan_loss@4:0"  # window 2: rank 1 runs out of memory; window 4: rank 0's loss is NaN
# two latent frames at 16x16: the same training step as the test preset's 9 frames at 32x32, for less compute
TINY = ["--n_frames=5", "--height=16", "--width=16"]
# with TINY: 2 clips x 8 decoded frames -> 4 groups a micro-batch; a replay buffer of 16 samples is full after 4
# micro-batches, so the runs also replace samples at random (its generator is part of the exact resume)
SERAENA = ["--use_seraena=true", "--train_batch_size=2", "--n_seraena_frames=4", "--seraena_buffer_size=16"]


def trainer_state(checkpoint) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def assert_same_training(full, resumed) -> None:
    """Bit-identical weights, EMA, optimizer state and validation history."""
    last = f"checkpoints/checkpoint-{STEPS}"
    assert_identical(full / "final_model.safetensors", resumed / "final_model.safetensors")
    for name in sorted(p.name for p in (full / last).glob("*.safetensors")):
        assert_identical(full / last / name, resumed / last / name)
    # measured on the wall clock: the seconds spent, what a validation and a checkpoint took, and
    # a time budget's plan (a process resumed before it measures again; here max_train_steps
    # ends the runs before any plan)
    wall_clock = {"train_seconds", "planned_steps", "validation_every", "validation_seconds", "checkpoint_seconds"}
    progress = [
        {k: v for k, v in trainer_state(run / last)["progress"].items() if k not in wall_clock}
        for run in (full, resumed)
    ]
    assert progress[0] == progress[1]
    assert trainer_state(full / last)["validation_history"] == trainer_state(resumed / last)["validation_history"]
    assert (full / "validation_history.json").read_text() == (resumed / "validation_history.json").read_text()


def interrupted_chain(launcher, out, clips, faults: str, *common: str, signal_rank: str = "") -> None:
    """SIGTERM in window 3 (to one rank only when given), resume; crash while writing
    checkpoint-4, resume to the end."""
    train(launcher, out, clips, *common, f"--fault_injection={faults},sigterm@3{signal_rank}")
    checkpoints = out / "run" / "checkpoints"
    assert [p.name for p in list_checkpoints(checkpoints)] == ["checkpoint-1", "checkpoint-2"]
    assert "stopped on" in (out / "run" / "train.log").read_text()

    crashed = subprocess.run(
        train_args(launcher, out, clips, *common, "--resume=latest", f"--fault_injection={faults},crash_in_save@4"),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert crashed.returncode != 0
    assert (checkpoints / ".tmp-checkpoint-4").is_dir() and not (
        checkpoints / ".tmp-checkpoint-4" / CHECKPOINT_MANIFEST
    ).exists()
    assert [p.name for p in list_checkpoints(checkpoints)] == ["checkpoint-2", "checkpoint-3"]  # nothing lost

    train(launcher, out, clips, *common, "--resume=latest", f"--fault_injection={faults}")
    assert not (checkpoints / ".tmp-checkpoint-4").exists()  # the partial save was cleaned up
    assert "resumed from" in (out / "run" / "train.log").read_text()


def test_exact_resume_after_sigterm_and_crash_during_save_on_two_deepspeed_processes(tmp_path, demo_clips):
    """ZeRO-2 with gradient accumulation, EMA, Seraena, a cosine schedule and a time budget whose
    clock the ranks agree on every step (max_train_steps, typed with it, ends the run before
    the budget has measured enough to plan; a plan and a resume after it:
    tests/test_time_budget.py); a single process resumes exactly in the SIGTERM and
    decoder-only tests below."""
    launcher = deepspeed_zero2(29541)
    common = [
        f"--max_train_steps={STEPS}",
        "--run_name=run",
        "--checkpoints_total_limit=2",
        "--checkpointing_steps=1",
        "--gradient_accumulation_steps=2",
        "--lr_scheduler=cosine",
        "--max_train_time=2h",
        "--use_ema=true",
        *TINY,
        *SERAENA,
    ]
    train(launcher, tmp_path / "full", demo_clips, *common, f"--fault_injection={FAULTS}")
    full = tmp_path / "full" / "run"
    state = trainer_state(full / f"checkpoints/checkpoint-{STEPS}")["progress"]
    assert (state["step"], state["skipped_steps"]) == (STEPS, 2)  # both faults skipped a step, none hung
    assert state["planned_steps"] == 0 and 0 < state["train_seconds"] < 2 * 3600  # max_train_steps came first

    interrupted_chain(launcher, tmp_path / "resumed", demo_clips, FAULTS, *common, signal_rank=":1")
    assert_same_training(full, tmp_path / "resumed" / "run")
    final = tensors(full / "final_model.safetensors")
    assert all(t.dtype == torch.float32 and bool(t.isfinite().all()) for t in final.values())
    ranks = [
        tensors(path) for path in sorted((full / f"checkpoints/checkpoint-{STEPS}").glob("seraena_rank*.safetensors"))
    ]
    weights = [k for k in ranks[0] if k.startswith("discriminator.")]  # ranks see different data, yet one discriminator
    assert len(ranks) == 2 and weights and all(torch.equal(ranks[0][k], ranks[1][k]) for k in weights)
    assert not torch.equal(ranks[0]["buffer.images"], ranks[1]["buffer.images"])  # each rank its own fakes


def test_too_many_consecutive_skips_stop_with_a_checkpoint(tmp_path, demo_clips):
    result = train(
        ONE_PROCESS,
        tmp_path,
        demo_clips,
        "--run_name=run",
        "--max_train_steps=20",
        "--fault_injection=nan_loss@3-100",
        "--max_consecutive_skipped_steps=3",
        *TINY,
        expect=1,
    )
    latest = list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    assert "3 steps in a row were skipped" in result.stderr and f"--resume {latest}" in result.stderr
    assert trainer_state(latest)["progress"]["step"] == 2 and f"saved {latest}" in result.stderr
    assert not (tmp_path / "run" / "final_model.safetensors").exists()


def launch_script(processes: int, out, clips, *overrides: str) -> list[str]:
    return [
        "bash",
        str(REPO_ROOT / "train_taehv_h100.sh"),
        str(processes),
        "test",
        f"--output_dir={out}",
        f"--data_root={clips['root']}",
        f"--annotation_file={clips['train']}",
        f"--val_annotation_file={clips['val']}",
        *overrides,
    ]


def launch_to_end(processes: int, out, clips, *overrides: str, env: dict) -> None:
    """Run the launch script to its end; it must exit 0."""
    result = subprocess.run(
        launch_script(processes, out, clips, *overrides),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def checkpoint_steps(checkpoints: Path) -> list[int]:
    return [checkpoint_step(c) for c in list_checkpoints(checkpoints)]


@pytest.mark.parametrize(
    "processes, launcher, options",
    [
        pytest.param(1, ONE_PROCESS, SERAENA, id="1-process-seraena"),
        pytest.param(2, deepspeed_zero2(29545), ["--mixed_precision=bf16"], id="2-process-deepspeed-zero2-bf16"),
    ],
)
def test_sigterms_during_decoder_only_fine_tuning_save_and_resume_exactly(
    tmp_path, demo_clips, processes, launcher, options
):
    """Decoder-only fine-tuning (train_encoder=false from stage-1 weights, with EMA), stopped
    twice as schedulers stop jobs, with DataLoader workers running: a SIGTERM to
    ./train_taehv_h100.sh alone (it forwards the signal), then one to every process
    of the job at once (scancel, preemption: launch script, launcher, training processes
    and their workers; the workers leave the stop to their parents). Each time the ranks
    stop at the same step boundary, save, exit 0 and log the exact resume command. Resumed
    twice, the run ends bit-identical to an uninterrupted one; the encoder comes out
    bit-identical to stage 1's (also when DeepSpeed keeps the module in bf16) and has no
    optimizer state."""
    from taehv_train.models.taehv import TAEHV
    from taehv_train.models.weights import save_weights

    torch.manual_seed(3)
    stage1 = save_weights(TAEHV(variant="taecvx"), tmp_path / "stage1.safetensors")
    steps = 10
    common = [
        "--run_name=run",
        f"--max_train_steps={steps}",
        "--checkpointing_steps=2",
        "--validation_every=5",
        "--dataloader_num_workers=1",
        "--persistent_workers=true",
        "--train_encoder=false",
        f"--pretrained_model_path={stage1}",
        "--use_ema=true",
        *TINY,
        *options,
    ]
    env = {"MASTER_PORT": str(29546 + processes)}
    train(launcher, tmp_path / "full", demo_clips, *common)

    out = tmp_path / "resumed"
    checkpoints = out / "run" / "checkpoints"
    stopped_at = 0
    for attempt, whole_job in enumerate((False, True)):
        resume = ["--resume", "latest"] if attempt else []
        output = tmp_path / f"stopped{attempt}.log"
        process = start(launch_script(processes, out, demo_clips, *common, *resume), output, env=env)
        wait_for(lambda: max(checkpoint_steps(checkpoints), default=0) > stopped_at, what="a new checkpoint")  # noqa: B023
        if whole_job:
            os.killpg(process.pid, signal.SIGTERM)  # the whole process group, as kill -TERM -- -PGID
        else:
            process.send_signal(signal.SIGTERM)  # the launch script only
        assert process.wait(timeout=300) == 0, output.read_text()[-4000:]
        assert "is killed by signal" not in output.read_text()
        previous, stopped_at = stopped_at, max(checkpoint_steps(checkpoints))
        assert previous < stopped_at < steps
        log = (out / "run" / "train.log").read_text()
        assert log.count("stopped on SIGTERM") == attempt + 1
        if previous:
            assert f"resumed from {checkpoints / f'checkpoint-{previous}'} at step {previous}" in log
        hint = [line for line in log.splitlines() if "Resume with: " in line][-1].split("Resume with: ")[1]
        assert hint.startswith(f"{REPO_ROOT / 'train_taehv_h100.sh'} {processes} test ") and "--run_name=run" in hint
        assert hint.endswith(f"--resume {checkpoints / f'checkpoint-{stopped_at}'}")  # the exact command

    launch_to_end(processes, out, demo_clips, *common, "--resume", "latest", env=env)
    assert checkpoint_steps(checkpoints)[-1] == steps
    full = tmp_path / "full" / "run"
    assert_identical(full / "final_model.safetensors", out / "run" / "final_model.safetensors")
    last = f"checkpoints/checkpoint-{steps}"
    for name in sorted(p.name for p in (full / last).glob("*.safetensors")):
        assert_identical(full / last / name, out / "run" / last / name)

    before, after = tensors(stage1), tensors(full / "final_model.safetensors")
    encoder = [k for k in before if k.startswith("encoder.")]
    assert encoder and all(torch.equal(before[k], after[k]) for k in encoder)  # bit-identical
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("decoder."))
    if launcher is ONE_PROCESS:  # AdamW state: one entry per decoder parameter, none for the encoder
        state = json.loads((full / last / "optimizer.json").read_text())["tree"]
        assert len(state["__dict__"][0][1]["__dict__"]) == sum(1 for k in before if k.startswith("decoder."))
    else:  # the ZeRO shards (decoder only, as the bit-identical encoder shows)
        assert len(sorted((full / last).glob("optimizer*.json"))) == 2


def data_gone_mid_run(tmp_path, which: str, ready, port: int, *overrides: str) -> tuple[str, Path, int]:
    """Train with 2 DeepSpeed processes (launch script) on demo clips, delete the clips of
    the ``which`` ("train" or "val") annotation once ``ready(run_dir)`` holds, and expect
    exit 2 with no traceback; returns (the error line, the last checkpoint, its step)."""
    from taehv_train.training.demo_data import make_demo_dataset

    clips = {
        "root": tmp_path / "data",
        **make_demo_dataset(tmp_path / "data", num_clips=6, n_frames=12, height=48, width=64, seed=1),
    }
    process = start(
        launch_script(2, tmp_path, clips, "--run_name=run", *overrides),
        tmp_path / "first.log",
        env={"MASTER_PORT": str(port)},
    )
    wait_for(lambda: ready(tmp_path / "run"), what="the run to get going")
    for entry in json.loads(clips[which].read_text())["list"]:
        (tmp_path / "data" / entry["path"]).unlink()
    assert exit_status(process) == 2, (tmp_path / "first.log").read_text()[-4000:]
    output = (tmp_path / "first.log").read_text()
    assert "Traceback" not in output
    kind = {"train": "training", "val": "validation"}[which]
    line = next(line for line in output.splitlines() if f"the {kind} data became unreadable" in line)
    assert f"error: the {kind} data became unreadable" in (tmp_path / "run" / "train.log").read_text()
    saved = list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    stopped_at = trainer_state(saved)["progress"]["step"]
    assert f"at step {stopped_at} " in line and f"saved {saved}" in line and "--resume" in line
    return line, saved, stopped_at


def test_training_data_gone_mid_run_saves_then_one_line(tmp_path):
    """All training clips deleted while 2 DeepSpeed processes train: the ranks agree that
    the data is gone, save the last completed step and exit 2 with one line; once the data
    is back, the printed command resumes the run to its end."""
    from taehv_train.training.demo_data import make_demo_dataset

    line, _, stopped_at = data_gone_mid_run(
        tmp_path,
        "train",
        lambda run: (run / "checkpoints" / "checkpoint-2").is_dir(),
        29549,
        "--max_train_steps=10",
        "--checkpointing_steps=2",
        "--validation_every=100",
        "--dataloader_num_workers=1",
    )
    assert 2 <= stopped_at < 10

    make_demo_dataset(tmp_path / "data", num_clips=6, n_frames=12, height=48, width=64, seed=1)  # the data is back
    resumed = subprocess.run(
        shlex.split(line.split("resume with: ")[1]),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env={**os.environ, "MASTER_PORT": "29549"},
    )
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    assert trainer_state(list_checkpoints(tmp_path / "run" / "checkpoints")[-1])["progress"]["step"] == 10


def test_validation_data_gone_on_one_rank_saves_then_one_line(tmp_path):
    """Validation clips deleted mid-run, with one validation sample so that rank 1 reads
    none: without an agreement rank 1 would wait in the gather for ever. The ranks agree,
    save the step just trained (the only checkpoint) and exit 2 with one line."""
    _, saved, stopped_at = data_gone_mid_run(
        tmp_path,
        "val",
        lambda run: (run / "validation_history.json").is_file(),
        29551,
        "--max_train_steps=60",
        "--checkpointing_steps=100",
        "--validation_every=2",
        "--num_validation_samples=1",
    )
    assert saved.name == f"checkpoint-{stopped_at}" and 2 < stopped_at < 60 and stopped_at % 2 == 0


def test_failed_starts_and_refused_resumes_leave_the_runs_as_they_were(tmp_path, demo_clips):
    """A configuration problem stops before any run folder exists; a start that fails later
    says why in its train.log and does not hide older runs from a bare checkpoint name; a
    checkpoint with damaged bytes is refused in one line, before the run's config.json is
    touched (one of another variant: test_checkpointing.py); --resume latest passes over
    the damaged checkpoint (of a run stopped at step 4 of 6, so unfinished; the resume
    line's --max_train_steps=4 ends it there). The refusals before a run folder exists and
    the resumes start in this process; the start that fails later is a process, whose
    exit status and train.log line are the entry point's."""
    common = ["--max_train_steps=4", "--checkpointing_steps=2", "--validation_every=100"]
    train(ONE_PROCESS, tmp_path, demo_clips, *common, "--max_train_steps=6", "--fault_injection=sigterm@4")
    (run,) = tmp_path.iterdir()
    config_json = (run / "config.json").read_bytes()

    def attempt(*overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            train_args(ONE_PROCESS, tmp_path, demo_clips, *common, *overrides),
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO_ROOT,
        )

    def refused(*overrides: str) -> str:
        return refused_here(tmp_path, demo_clips, *common, *overrides)

    assert re.search(
        r"one training step keeps about [0-9.]+ GiB of activations .* at 16384x16384, .*, more than the "
        r"[0-9.]+ GiB of",
        refused("--height=16384", "--width=16384"),
    )
    assert "cannot write the run directory under /proc/taehv_out: No such file or directory" in refused(
        "--output_dir=/proc/taehv_out"
    )
    assert list(tmp_path.iterdir()) == [run]  # the check ran before any folder was made
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps({"total": 1, "list": [{"path": "gone.mp4", "frames": 12}]}))
    assert "probed clips are unusable" in one_line_error(attempt(f"--annotation_file={missing}"))
    (failed,) = set(tmp_path.iterdir()) - {run, missing}
    assert "error: " in (failed / "train.log").read_text() and not (failed / "checkpoints").exists()

    damaged = run / "checkpoints" / "checkpoint-4" / "model.safetensors"
    with open(damaged, "r+b") as f:  # 4 MiB overwritten in place: same size
        f.seek(damaged.stat().st_size // 2)
        f.write(os.urandom(4 << 20))
    line = refused("--resume", "checkpoint-4")
    assert "checkpoint-4 is damaged (model.safetensors checksum); resume from checkpoint-2" in line
    assert (run / "config.json").read_bytes() == config_json

    train_here(tmp_path, demo_clips, *common, "--resume", "latest")
    log = (run / "train.log").read_text()
    assert "skipping checkpoint-4 is damaged" in log and f"resumed from {run / 'checkpoints' / 'checkpoint-2'}" in log
    assert "from scratch" not in log.split("resumed from")[0].rsplit("run directory", 1)[1]  # the resumed start
    assert trainer_state(list_checkpoints(run / "checkpoints")[-1])["progress"]["step"] == 4  # checkpoint-4 rewritten


@pytest.mark.skipif(
    subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0,
    reason="needs unshare -rm (a private mount namespace) for a small tmpfs",
)
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path, demo_clips):
    """A real full disk: the run's folder is a tmpfs. At 3 MiB the first save fails: one
    line says what it needs (the estimate of the state, not what got written) and, with
    nothing to resume, prints the command that starts again. Given room for one
    checkpoint, that command's second save fails on every rank's write with ENOSPC; the
    run exits 2 with one line (folder, space needed, space free), keeps checkpoint-2, and
    the printed command resumes once there is room."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir(), logs.mkdir()
    args = shlex.join(
        train_args(
            ONE_PROCESS,
            out,
            demo_clips,
            "--run_name=run",
            "--max_train_steps=4",
            "--checkpointing_steps=2",
            "--validation_every=100",
        )
    )
    script = f"""
        mount -t tmpfs -o size=3m none {out}
        {args} > {logs}/tiny.out 2> {logs}/tiny.err; echo $? > {logs}/tiny.status
        ls -A {out}/run/checkpoints > {logs}/tiny.kept
        mount -o remount,size=330m {out}
        grep -o 'start again with: .* (nothing' {logs}/tiny.err | cut -c19- | sed 's/ (nothing$//' > {logs}/restart
        bash -c "$(cat {logs}/restart)" > {logs}/first.out 2> {logs}/first.err; echo $? > {logs}/first.status
        ls {out}/run/checkpoints > {logs}/kept
        mount -o remount,size=1g {out}
        grep -o 'resume with: .*' {logs}/first.err | cut -c14- > {logs}/command
        bash -c "$(cat {logs}/command)" > {logs}/second.out 2>&1; echo $? > {logs}/second.status
        cat {out}/run/checkpoints/checkpoint-4/trainer_state.json > {logs}/state.json
        du -bs {out}/run/checkpoints/checkpoint-4 | cut -f1 > {logs}/checkpoint.bytes
    """
    subprocess.run(["unshare", "-rm", "bash", "-c", script], cwd=REPO_ROOT, timeout=600, check=True)

    def outcome(name: str) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(
            [],
            int((logs / f"{name}.status").read_text()),
            (logs / f"{name}.out").read_text(),
            (logs / f"{name}.err").read_text(),
        )

    line = one_line_error(outcome("tiny"))
    needed = re.search(
        r"no space left to save checkpoint-2 in .*/run/checkpoints: it needs about ([0-9.]+ .iB) and "
        r"[0-9.]+ .iB are free; nothing was saved\. .*, then start again with: (.*) \(nothing to resume "
        r"yet\)$",
        line,
    )
    assert needed, line
    assert (logs / "tiny.kept").read_text() == ""  # no partial folder
    assert "--resume" not in needed.group(2) and (logs / "restart").read_text().strip() == needed.group(2)
    line = one_line_error(outcome("first"))
    assert re.search(
        r"no space left to save checkpoint-4 in .*/run/checkpoints: it needs about [0-9.]+ .iB and "
        r"[0-9.]+ .iB are free; checkpoint-2 kept intact. .*, then resume with: .* --resume latest$",
        line,
    ), line
    number, unit = needed.group(1).split()
    estimate, saved = float(number) * 2 ** (30 if unit == "GiB" else 20), int((logs / "checkpoint.bytes").read_text())
    assert 0.9 * saved < estimate < 1.05 * saved  # the estimate of the first save against what a save takes
    assert (logs / "kept").read_text().split() == ["checkpoint-2"]  # no partial folder either
    assert int((logs / "second.status").read_text()) == 0, (logs / "second.out").read_text()[-3000:]
    assert json.loads((logs / "state.json").read_text())["progress"]["step"] == 4


def test_ctrl_c_during_start_up_stops_cleanly(tmp_path, demo_clips):
    """Ctrl+C (SIGINT to the terminal's process group) while training is still starting:
    it stops before the first step, says so, and exits 0 with nothing to save."""
    process = start(launch_script(1, tmp_path, demo_clips, "--run_name=run"), tmp_path / "out.log")
    wait_for(lambda: "launch:" in (tmp_path / "out.log").read_text(), what="the launch")
    time.sleep(0.5)  # inside the training process's start-up (imports, data probe)
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=120) == 0, (tmp_path / "out.log").read_text()[-3000:]
    output = (tmp_path / "out.log").read_text()
    assert "stopped on SIGINT during start-up, before the first step" in output and "Traceback" not in output
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_kill_9_at_a_random_moment_loses_no_checkpoint(tmp_path, demo_clips):
    args = train_args(
        ONE_PROCESS,
        tmp_path,
        demo_clips,
        "--run_name=run",
        "--max_train_steps=16",
        "--checkpointing_steps=3",
        "--validation_every=100",
        "--auto_resume=true",
    )
    checkpoints = tmp_path / "run" / "checkpoints"
    process = start(args, tmp_path / "first.log")
    wait_for(lambda: len(list_checkpoints(checkpoints)) >= 1, what="a first checkpoint")
    time.sleep(random.uniform(0, 2))  # a random moment: mid-step, mid-validation or mid-save
    kill_session(process)
    before = [p.name for p in list_checkpoints(checkpoints)]
    assert before, "the first checkpoint must survive kill -9"

    train(
        ONE_PROCESS,
        tmp_path,
        demo_clips,
        "--run_name=run",
        "--max_train_steps=16",
        "--checkpointing_steps=3",
        "--validation_every=100",
        "--auto_resume=true",
    )  # the same command restarts the job
    after = list_checkpoints(checkpoints)
    assert trainer_state(after[-1])["progress"]["step"] == 16
    assert all((p / CHECKPOINT_MANIFEST).is_file() for p in after)
    assert not list(checkpoints.glob(".tmp-*"))


def test_kill_9_of_the_launcher_or_of_the_whole_job_leaves_no_process_and_the_run_resumes(tmp_path, demo_clips):
    """The launch script with 2 DeepSpeed processes and a loader worker each; torch elastic
    starts the training processes in sessions of their own, which neither signal reaches.
    kill -9 of the launcher alone (the script then exits 137), then, resumed, kill -9 of the
    script's whole process group, each once a new checkpoint exists: no process of the job
    is left (training processes and loader workers end with their parents), the run lock is
    free, and --resume latest continues from the newest checkpoint and finishes."""
    steps = 5
    common = [
        "--run_name=run",
        f"--max_train_steps={steps}",
        "--checkpointing_steps=1",
        "--validation_every=100",
        "--dataloader_num_workers=1",
    ]
    env = {"MASTER_PORT": "29561"}
    run = tmp_path / "run"
    stopped_at = 0
    for attempt, killed in enumerate(("launcher", "job")):
        resume = ["--resume", "latest"] if attempt else []
        script = start(launch_script(2, tmp_path, demo_clips, *common, *resume), tmp_path / f"{killed}.log", env=env)
        wait_for(lambda: max(checkpoint_steps(run / "checkpoints"), default=0) > stopped_at, what="a new checkpoint")  # noqa: B023
        job = processes_of(tmp_path)
        assert len(job) == 6  # the script, the launcher, 2 training processes, their 2 workers
        if killed == "launcher":
            os.kill(child_running(script.pid, "taehv_train.training.launch"), signal.SIGKILL)
            assert exit_status(script, timeout=60) == 137
        else:
            kill_session(script)
        wait_for(lambda: all_ended(job), timeout=30, what="every process of the job to end")  # noqa: B023
        release_run_dir(lock_run_dir(run))  # free: a UserError naming the holder otherwise
        previous, stopped_at = stopped_at, max(checkpoint_steps(run / "checkpoints"))
        assert previous < stopped_at < steps
        if previous:
            assert (
                f"resumed from {run / 'checkpoints' / f'checkpoint-{previous}'} at step {previous}"
                in (run / "train.log").read_text()
            )

    launch_to_end(2, tmp_path, demo_clips, *common, "--resume", "latest", env=env)
    assert (
        f"resumed from {run / 'checkpoints' / f'checkpoint-{stopped_at}'} at step {stopped_at}"
        in (run / "train.log").read_text()
    )
    assert checkpoint_steps(run / "checkpoints")[-1] == steps


def test_skipped_steps_early_stopping_and_best_model_on_two_ddp_processes(tmp_path, demo_clips):
    """Plain DDP on CPU, windows of 2 micro-batches. Out of memory on rank 1 in window 2 and a
    NaN loss on rank 0 in window 4: each window is skipped on both ranks (no hang) and
    counted. Patience 1 with an unreachable min_delta: the second validation (step 4) stops
    the run on both ranks at once, best_model/ keeps the first validation's weights, and
    every exported file loads strictly."""
    train(
        ddp(29542),
        tmp_path,
        demo_clips,
        "--run_name=run",
        "--max_train_steps=20",
        "--gradient_accumulation_steps=2",
        f"--fault_injection={FAULTS}",
        "--validation_every=2",
        "--early_stopping_patience=1",
        "--early_stopping_min_delta=1000",
        *TINY,
        env=DDP_ENV,
    )
    run = tmp_path / "run"
    log = (run / "train.log").read_text()
    assert "step 2 skipped on every rank: out of memory" in log
    assert "step 3 skipped on every rank: non-finite loss" in log
    events = EventAccumulator(str(run / "logs"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/skipped_steps")] == [1.0, 2.0]
    history = json.loads((run / "validation_history.json").read_text())
    assert [h["step"] for h in history] == [2, 4]
    info = json.loads((run / "best_model" / "model_info.json").read_text())
    assert (info["step"], info["metric"], info["value"]) == (2, "val/psnr", history[0]["val/psnr"])
    assert "2 process(es), DistributedType.MULTI_CPU" in log and "early stopping at step 4" in log
    progress = trainer_state(list_checkpoints(run / "checkpoints")[-1])["progress"]
    assert (progress["step"], progress["skipped_steps"]) == (4, 2)
    from taehv_train.models.taehv import TAEHV

    for weights in (
        run / "best_model" / "weights.safetensors",
        run / "best_model" / "weights.pth",
        run / "final_model.safetensors",
        run / "final_model.pth",
    ):
        TAEHV(weights, variant="taecvx")  # strict load of full fp32 published-format weights


def test_a_late_sigterm_stops_its_window_and_kill_9_of_one_rank_is_one_line(tmp_path, demo_clips):
    """Through ``python -m taehv_train.training.launch``, 2 DDP processes, windows of 2 micro-batches.
    A SIGTERM that reaches rank 1 at the end of window 2, after its last backward pass, is in
    that window's agreement: both ranks save checkpoint-2 and stop there, not a window later.
    The printed command resumes (with a loader worker per process); then kill -9 of rank 1:
    rank 0 loses contact and stops, the job ends in one line on stderr (and in train.log)
    naming the rank, the signal and the command that resumes, with exit status 137 and no
    traceback, and no process of the job is left (rank 1's worker ends with it)."""
    run, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    train(
        wrapped_ddp(29557),
        tmp_path,
        demo_clips,
        "--run_name=run",
        "--gradient_accumulation_steps=2",
        "--max_train_steps=40",
        "--checkpointing_steps=100",
        "--validation_every=100",
        "--fault_injection=sigterm@2:1",
        *TINY,
        env=DDP_ENV,
    )
    assert checkpoint_steps(run / "checkpoints") == [2]
    stopped = next(line for line in (run / "train.log").read_text().splitlines() if "stopped on" in line)
    assert "stopped on a signal received by another rank at step 2" in stopped
    resume = shlex.split(stopped.split("Resume with: ")[1])
    assert resume[:3] == [sys.executable, "-m", "taehv_train.training.launch"]  # the launcher's own command line

    with open(logs / "out", "w") as out, open(logs / "err", "w") as err:
        process = subprocess.Popen(
            [*resume, "--checkpointing_steps=1", "--dataloader_num_workers=1"],
            stdout=out,
            stderr=err,
            cwd=REPO_ROOT,
            env={**os.environ, **DDP_ENV},
            start_new_session=True,
        )
    wait_for(lambda: 4 in checkpoint_steps(run / "checkpoints"), what="checkpoint-4")
    job = processes_of(tmp_path)
    assert len(job) == 5  # the launcher, 2 training processes, their 2 workers
    os.kill(rank_pid(process, 1), signal.SIGKILL)
    assert exit_status(process) == 137, (logs / "err").read_text()[-4000:]
    wait_for(lambda: all_ended(job), timeout=30, what="every process of the job to end")
    output = (logs / "out").read_text() + (logs / "err").read_text()
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-4000:]
    assert "lost contact with another process of the run (Connection" in output  # rank 0's own line
    last = (logs / "err").read_text().strip().splitlines()[-1]
    assert last.startswith("error: rank 1 died (signal 9, SIGKILL: kill -9 or out of memory, see dmesg): resume with: ")
    command = shlex.split(last.split("): resume with: ")[1])
    assert command[:3] == [sys.executable, "-m", "taehv_train.training.launch"] and command[-2:] == [
        "--resume",
        "latest",
    ]
    assert (run / "train.log").read_text().strip().endswith(last)
    assert all((c / CHECKPOINT_MANIFEST).is_file() for c in list_checkpoints(run / "checkpoints"))


def test_one_writer_per_run_and_kill_9_in_the_middle_of_saves(tmp_path, demo_clips):
    """A second run into the folder of a running one (2 DeepSpeed processes) is refused in
    one line naming the first, on every rank, and the first goes on. Then kill -9 of the
    run while it writes a checkpoint, three times in a row: each time `--resume latest`
    removes the partial folder and continues from the newest intact checkpoint."""
    common = [
        "--run_name=run",
        "--max_train_steps=400",
        "--checkpointing_steps=1",
        "--validation_every=1000",
        "--checkpoints_total_limit=2",
    ]
    checkpoints = tmp_path / "run" / "checkpoints"
    process = start(train_args(ONE_PROCESS, tmp_path, demo_clips, *common), tmp_path / "first.log")
    wait_for(lambda: (checkpoints / "checkpoint-1").is_dir(), what="checkpoint-1")
    second = subprocess.run(
        launch_script(2, tmp_path, demo_clips, *common),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env={**os.environ, "MASTER_PORT": "29553"},
    )
    line = one_line_error(second)
    assert f"{tmp_path / 'run'} is being written by another training run (pid {process.pid} on " in line, line
    assert process.poll() is None  # the first run goes on

    def saving() -> bool:
        return any(p.name.startswith(TMP_PREFIX) for p in checkpoints.iterdir())

    partial_saves = 0
    for attempt in range(3):
        wait_for(saving, timeout=120, what="a checkpoint being written", interval=0.002)
        process.kill()
        process.wait()
        partial = saving()  # else the kill landed just after the save's rename
        partial_saves += partial
        newest = list_checkpoints(checkpoints)[-1]
        process = start(
            train_args(ONE_PROCESS, tmp_path, demo_clips, *common, "--resume", "latest"),
            tmp_path / f"resumed{attempt}.log",
        )
        wait_for(lambda: "resumed from" in (tmp_path / f"resumed{attempt}.log").read_text(), what="the resume")  # noqa: B023
        log = (tmp_path / f"resumed{attempt}.log").read_text()
        assert f"resumed from {newest} " in log, log[-3000:]
        assert ("left by a checkpoint save that did not finish" in log) == partial
    assert partial_saves >= 2  # the kills do land in the middle of saves
    process.kill()
    process.wait()
