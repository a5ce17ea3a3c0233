"""Loader workers that stall or die, with real signals on real worker processes: a stopped
worker (SIGSTOP, standing in for a hung storage read) never keeps a stop signal from being
honoured nor the process from exiting, and past ``batch_timeout`` it ends the run with a
checkpoint and one line on every rank; a killed worker (kill -9, the out-of-memory killer)
ends the run with a checkpoint of the last step and one line, and the resumed run is
bit-identical to an uninterrupted one. A rank waiting for its batch says so while it waits.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset

from conftest import REPO_ROOT
from taehv_train.common.config import TrainConfig
from taehv_train.training.data import prefetch
from taehv_train.training.data.clip_loader import tie_worker_to_parent
from taehv_train.training.data.loader_workers import LoaderFault
from taehv_train.training.data.prefetch import Prefetcher
from taehv_train.training.loop.distributed import collective_timeout
from taehv_train.training.loop.progress import Progress
from taehv_train.training.state.run_folders import checkpoint_step, list_checkpoints
from train_runs import (
    ONE_PROCESS,
    assert_identical,
    child_running,
    exit_status,
    rank_pid,
    start,
    train,
    train_args,
    wait_for,
)

WORKER_NAME = "pt_data_worker"  # the name torch gives its DataLoader worker processes


class Numbers(Dataset):
    """Tiny tensors; reading one from ``block_from`` on waits until ``release`` is set."""

    def __init__(self, count: int, block_from: int = -1):
        self.count, self.block_from = count, block_from
        self.release = torch.multiprocessing.Event()

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        if 0 <= self.block_from <= index:
            self.release.wait()
        return torch.full((2,), index)


def loader_worker_of(parent: int) -> int:
    """The pid of ``parent``'s one DataLoader worker process (found in /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, rest = stat.read_text().rsplit(")", 1)
        except OSError:  # ended meanwhile
            continue
        if name.split("(", 1)[1] == WORKER_NAME and int(rest.split()[1]) == parent:
            found.append(int(stat.parent.name))
    assert len(found) == 1, f"expected one loader worker of {parent}, found {found}"
    return found[0]


def rank_process(script: subprocess.Popen, rank: int) -> int:
    """The training process of ``rank`` under the launch script ``script``."""
    return rank_pid(child_running(script.pid, "taehv_train.training.launch"), rank)


def newest_step(checkpoints: Path) -> int:
    return max((checkpoint_step(p) for p in list_checkpoints(checkpoints)), default=0) if checkpoints.is_dir() else 0


def logged_step(run: Path) -> int:
    """The last step the run's train.log reports (the test preset logs every step); the runs
    here save checkpoints only where they stop, end or fail, so their checkpoints are the
    ones those save."""
    log = run / "train.log"
    return max(map(int, re.findall(r"step (\d+): loss", log.read_text())), default=0) if log.is_file() else 0


def stalled(run: Path, quiet_s: float = 6.0) -> None:
    """Wait until no new step was logged for ``quiet_s`` seconds: the run has most likely
    used up the batches received before its worker stopped and waits (a step on a busy
    machine can take longer: the stop then comes before the wait)."""
    last, since = logged_step(run), time.monotonic()
    deadline = since + 120
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, "the run went on training with a stopped loader worker"
        time.sleep(0.5)
        if (step := logged_step(run)) != last:
            last, since = step, time.monotonic()


def test_a_rank_waiting_for_its_batch_says_so_until_the_bound(monkeypatch, caplog):
    monkeypatch.setattr(prefetch, "WAIT_LOG_S", 0.3)
    accelerator = Accelerator(cpu=True)
    numbers = Numbers(3, block_from=0)
    batches = Prefetcher(accelerator.prepare(DataLoader(numbers)), accelerator, Progress(), batch_timeout=1.2)
    try:
        with caplog.at_level(logging.WARNING, logger=prefetch.__name__):
            item = next(batches)
    finally:
        numbers.release.set()
        batches.close()
    assert isinstance(item.batch, LoaderFault) and "within 1.2 s (batch_timeout)" in item.batch.reason
    waits = [r.getMessage() for r in caplog.records if "for the next batch from the loader" in r.getMessage()]
    assert len(waits) >= 2, waits
    assert waits[0].startswith("waiting 0 s") or waits[0].startswith("waiting 1 s")
    assert all(w.endswith("(gives up after batch_timeout=1.2 s)") for w in waits)


@pytest.mark.parametrize("batch_timeout", [TrainConfig().batch_timeout, 3600.0])
def test_the_other_ranks_outwait_a_rank_that_waits_for_its_batch(batch_timeout):
    """A rank gives up on its batch after ``batch_timeout`` and then joins the window's
    agreement: the collectives in which the other ranks wait for it last longer."""
    assert collective_timeout(batch_timeout).total_seconds() >= batch_timeout + 300
    assert collective_timeout(0) == collective_timeout(batch_timeout / 10) == timedelta(minutes=30)


@pytest.fixture
def no_sigchld_handler():
    """SIGCHLD at its default while the test runs: a DataLoader iterated in the main thread
    (by an earlier test in this process) installs a handler that raises in the main thread
    when a worker dies; training iterates in the prefetching thread, which installs none."""
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGCHLD, previous)


def worker_prefetcher(numbers: Numbers) -> Prefetcher:
    """A prefetcher over ``numbers`` with one persistent loader worker, as training builds it."""
    accelerator = Accelerator(cpu=True)
    workers = dict(num_workers=1, persistent_workers=True, worker_init_fn=tie_worker_to_parent)
    return Prefetcher(accelerator.prepare(DataLoader(numbers, **workers)), accelerator, Progress())


def test_a_killed_worker_takes_its_batchs_place_and_a_stopped_one_is_ended(no_sigchld_handler):
    """Real signals on the real loader worker of a prefetcher in this process: after kill -9
    the next items are the batches received before, then a LoaderFault naming the worker
    and the signal; a stopped worker (SIGSTOP) that owes a batch does not keep ``close``
    waiting, and is gone after it."""
    batches = worker_prefetcher(Numbers(6))
    try:
        assert int(next(batches).batch[0, 0]) == 0
        worker = loader_worker_of(os.getpid())
        os.kill(worker, signal.SIGKILL)
        items = [next(batches).batch for _ in range(5)]
    finally:
        batches.close()
    faults = [item for item in items if not isinstance(item, torch.Tensor)]
    assert faults and all(isinstance(item, LoaderFault) for item in faults)
    assert items.index(faults[0]) + len(faults) == len(items)  # every item after the first fault is one
    assert faults[0].reason == (
        f"loader worker pid {worker} was killed by signal 9 (SIGKILL), likely out of memory (the kernel's OOM "
        "killer, see dmesg) or a kill -9"
    )

    batches = worker_prefetcher(Numbers(4, block_from=2))  # the prepared loader reads one batch ahead
    assert int(next(batches).batch[0, 0]) == 0
    stopped = loader_worker_of(os.getpid())
    os.kill(stopped, signal.SIGSTOP)
    started = time.monotonic()
    batches.close()
    assert time.monotonic() - started < 15 and not Path(f"/proc/{stopped}").exists()


@pytest.mark.slow  # training processes
def test_stalled_and_killed_workers_of_one_process_save_and_resume_exactly(tmp_path, demo_clips):
    """One process with a loader worker, real signals: the worker stopped (SIGSTOP) and the
    run waiting for it, a SIGTERM stops the run at once with a checkpoint and the resume
    command, exit 0; resumed, its worker killed (kill -9) ends the run with exit 2, a
    checkpoint of the last step and one line naming the worker, the signal and the resume
    command (stderr and train.log); that command trains to the end, bit-identical to a run
    never interrupted."""
    steps = 12
    common = ["--run_name=run", f"--max_train_steps={steps}", "--checkpointing_steps=100", "--validation_every=100"]
    common += ["--dataloader_num_workers=1"]
    train(ONE_PROCESS, tmp_path / "full", demo_clips, *common)

    out = tmp_path / "resumed"
    checkpoints = out / "run" / "checkpoints"
    process = start(train_args(ONE_PROCESS, out, demo_clips, *common), tmp_path / "stopped.log")
    wait_for(lambda: logged_step(out / "run") >= 1, what="the first step")
    os.kill(loader_worker_of(process.pid), signal.SIGSTOP)
    stalled(out / "run")
    process.send_signal(signal.SIGTERM)
    assert exit_status(process, timeout=60) == 0, (tmp_path / "stopped.log").read_text()[-3000:]
    stopped_at = newest_step(checkpoints)
    assert stopped_at == logged_step(out / "run")  # the checkpoint the stop saved
    log = (out / "run" / "train.log").read_text()
    assert f"stopped on SIGTERM at step {stopped_at}; saved {checkpoints / f'checkpoint-{stopped_at}'}" in log
    assert f"--resume {checkpoints / f'checkpoint-{stopped_at}'}" in log
    assert stopped_at < steps

    process = start(train_args(ONE_PROCESS, out, demo_clips, *common, "--resume=latest"), tmp_path / "killed.log")
    wait_for(lambda: logged_step(out / "run") > stopped_at, what="a step of the resumed run")
    worker = loader_worker_of(process.pid)
    os.kill(worker, signal.SIGKILL)
    assert exit_status(process, timeout=120) == 2
    output = (tmp_path / "killed.log").read_text()
    assert "Traceback" not in output
    killed_at = newest_step(checkpoints)
    line = next(line for line in output.splitlines() if "error: " in line)
    assert (
        f"error: the data loader failed at step {killed_at}: loader worker pid {worker} was killed by signal 9 "
        f"(SIGKILL), likely out of memory" in line
    )
    assert line.split("error: ")[1] in (out / "run" / "train.log").read_text()
    assert f"saved {checkpoints / f'checkpoint-{killed_at}'}" in line and killed_at < steps

    resume = shlex.split(line.split("resume with: ")[1])
    finished = subprocess.run(resume, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert finished.returncode == 0, finished.stderr[-3000:]
    full = tmp_path / "full" / "run"
    assert_identical(full / "final_model.safetensors", out / "run" / "final_model.safetensors")
    last = f"checkpoints/checkpoint-{steps}"
    for name in sorted(p.name for p in (full / last).glob("*.safetensors")):
        assert_identical(full / last / name, out / "run" / last / name)


@pytest.mark.slow  # training processes
def test_stalled_workers_of_two_processes_stop_on_sigterm_and_at_the_bound(tmp_path, demo_clips):
    """Two DeepSpeed processes through the launch script, a loader worker each, real
    signals: with rank 1's worker stopped (SIGSTOP) and the run waiting for it, a SIGTERM to
    the launch script stops the run with a checkpoint and the resume command, exit 0;
    resumed with a short ``batch_timeout``, rank 0's worker stopped, both ranks agree at the
    bound: a checkpoint of the last step, exit 2, a line with the resume command from each."""
    common = ["--run_name=run", "--max_train_steps=60", "--checkpointing_steps=100", "--validation_every=100"]
    common += ["--dataloader_num_workers=1"]
    env = {"MASTER_PORT": "29571"}
    checkpoints = tmp_path / "run" / "checkpoints"
    script = [
        "bash",
        str(REPO_ROOT / "train_taehv_h100.sh"),
        "2",
        "test",
        f"--output_dir={tmp_path}",
        f"--data_root={demo_clips['root']}",
        f"--annotation_file={demo_clips['train']}",
        f"--val_annotation_file={demo_clips['val']}",
        *common,
    ]
    process = start(script, tmp_path / "stopped.log", env=env)
    wait_for(lambda: logged_step(tmp_path / "run") >= 1, what="the first step")
    os.kill(loader_worker_of(rank_process(process, 1)), signal.SIGSTOP)
    stalled(tmp_path / "run")
    process.send_signal(signal.SIGTERM)
    assert exit_status(process, timeout=90) == 0, (tmp_path / "stopped.log").read_text()[-3000:]
    stopped_at = newest_step(checkpoints)
    assert stopped_at == logged_step(tmp_path / "run")  # the checkpoint the stop saved
    output = (tmp_path / "stopped.log").read_text()
    assert "Traceback" not in output
    assert f"stopped on SIGTERM at step {stopped_at}; saved {checkpoints / f'checkpoint-{stopped_at}'}" in output
    assert f"--resume {checkpoints / f'checkpoint-{stopped_at}'}" in output

    process = start([*script, "--resume", "latest", "--batch_timeout=5"], tmp_path / "bound.log", env=env)
    wait_for(lambda: logged_step(tmp_path / "run") > stopped_at, what="a step of the resumed run")
    os.kill(loader_worker_of(rank_process(process, 0)), signal.SIGSTOP)
    assert exit_status(process, timeout=120) == 2, (tmp_path / "bound.log").read_text()[-3000:]
    output = (tmp_path / "bound.log").read_text()
    assert "Traceback" not in output
    saved = list_checkpoints(checkpoints)[-1]
    step = checkpoint_step(saved)
    lines = [line for line in output.splitlines() if "error: " in line and "resume with: " in line]
    assert any(
        f"[rank 0] ERROR taehv_train: error: the data loader failed at step {step}: no batch came from the loader "
        "within 5 s (batch_timeout)" in line
        for line in lines
    ), lines
    assert any(
        f"[rank 1] ERROR taehv_train: error: the training data became unreadable at step {step} on another process "
        "of the run, or its loader failed there" in line
        for line in lines
    ), lines
    assert all(f"saved {saved}." in line and line.endswith(f"--resume {saved}") for line in lines), lines
