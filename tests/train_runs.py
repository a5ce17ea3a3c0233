"""Running real training processes in tests: launchers, runs, and what they leave behind."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from conftest import REPO_ROOT

TRAIN = ["-m", "taehv_train.training.taehv_train"]  # run as a module from the repository root
TEST_CONFIG = str(REPO_ROOT / "training" / "configs" / "taehv_config_test.py")
SCRATCH_CONFIG = str(REPO_ROOT / "training" / "configs" / "taehv_config_scratch.py")
# the from-scratch preset at the test preset's sizes (its name is what a run's expectations are looked up by)
SCRATCH_AT_TEST_SIZES = (
    "--width=32",
    "--train_batch_size=1",
    "--mixed_precision=no",
    "--frame_cache_mb=0",
    "--dataloader_num_workers=0",
    "--num_validation_samples=2",
)
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
ONE_PROCESS = [sys.executable]


def deepspeed_zero2(port: int) -> list[str]:
    return [
        ACCELERATE,
        "launch",
        "--use_deepspeed",
        "--zero_stage",
        "2",
        "--num_machines",
        "1",
        "--num_processes",
        "2",
        "--main_process_port",
        str(port),
    ]


def ddp(port: int) -> list[str]:
    """Plain DDP over 2 CPU processes (needs ACCELERATE_USE_CPU=true in the environment)."""
    return [
        ACCELERATE,
        "launch",
        "--multi_gpu",
        "--num_machines",
        "1",
        "--num_processes",
        "2",
        "--main_process_port",
        str(port),
    ]


DDP_ENV = {"ACCELERATE_USE_CPU": "true"}


def wrapped_ddp(port: int) -> list[str]:
    """``ddp`` through ``python -m taehv_train.training.launch``, as the launch script runs accelerate."""
    return [sys.executable, "-m", "taehv_train.training.launch", *ddp(port)[2:]]


def wrapped_zero2(port: int) -> list[str]:
    """``deepspeed_zero2`` through ``python -m taehv_train.training.launch``, as the launch script runs accelerate."""
    return [sys.executable, "-m", "taehv_train.training.launch", *deepspeed_zero2(port)[2:]]


def tiny_train_step(
    frames: int,
    size: int,
    faults: str = "",
    stop=None,
    latents=None,
    loader=None,
    **changes,
):
    """The training step as the loop builds it in one CPU process, for a taehv of ``frames``
    frames of ``size`` x ``size`` (by default one clip a micro-batch, fp32, constant LR):
    (step, the prepared ``loader``)."""
    from accelerate import Accelerator

    from taehv_train.common.config import TrainConfig
    from taehv_train.models.taehv import TAEHV
    from taehv_train.training.data.loading import ReferenceLatents
    from taehv_train.training.loop.accelerator import accumulation_plugin
    from taehv_train.training.loop.resilience import FaultPlan
    from taehv_train.training.loop.step import TrainStep

    defaults = {"train_batch_size": 1, "mixed_precision": "no", "lr_scheduler": "constant", "lr_warmup_steps": 0}
    config = TrainConfig(variant="taehv", n_frames=frames, height=size, width=size, **{**defaults, **changes})
    torch.manual_seed(0)
    train_step, loader = TrainStep.build(
        config,
        Accelerator(cpu=True, gradient_accumulation_plugin=accumulation_plugin(config)),
        TAEHV(variant="taehv"),
        latents or ReferenceLatents(None, cached=False),
        FaultPlan.parse(faults),
        stop,
        loader=loader,
    )
    train_step.model.train()
    return train_step, loader


def rank_pid(launcher: subprocess.Popen | int, rank: int) -> int:
    """The pid of training process ``rank`` among the launcher's children (the launcher: its process or pid)."""
    parent = launcher if isinstance(launcher, int) else launcher.pid
    children = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    for pid in children:
        if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            return int(pid)
    raise AssertionError(f"no rank {rank} among the children {children} of {parent}")


def child_running(parent: int, module: str) -> int:
    """The pid of ``parent``'s child process running ``python -m module``."""
    for pid in subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split():
        if module.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
            return int(pid)
    raise AssertionError(f"no child of {parent} runs {module}")


def processes_of(marker: Path) -> list[int]:
    """The processes whose command line names ``marker`` (a test's own folder: the launch
    script, the launcher, the training processes and the loader or probe workers they fork,
    which share their command line). A process that is ending has none: ``all_ended`` tells
    when the ones found have let their files (the run lock) go."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                command = (entry / "cmdline").read_bytes()
            except OSError:  # ended meanwhile
                continue
            if str(marker).encode() in command:
                found.append(int(entry.name))
    return found


def all_ended(pids: list[int]) -> bool:
    """Whether every process of ``pids`` has ended: gone, or a zombie whose threads have all
    ended (the last one closes the process's files: the run lock)."""
    for pid in pids:
        for thread in Path(f"/proc/{pid}/task").glob("*"):
            try:
                state = (thread / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:  # ended meanwhile
                continue
            if state not in ("Z", "X"):
                return False
    return True


def training_options(out: Path, data: dict, *overrides: str, config: str = TEST_CONFIG) -> list[str]:
    return [
        "--config",
        config,
        f"--output_dir={out}",
        f"--data_root={data['root']}",
        f"--annotation_file={data['train']}",
        f"--val_annotation_file={data['val']}",
        *overrides,
    ]


def train_args(launcher: list[str], out: Path, data: dict, *overrides: str, config: str = TEST_CONFIG) -> list[str]:
    return [*launcher, *TRAIN, *training_options(out, data, *overrides, config=config)]


def train(
    launcher: list[str],
    out: Path,
    data: dict,
    *overrides: str,
    env: dict | None = None,
    timeout: int = 300,
    expect: int = 0,
    config: str = TEST_CONFIG,
) -> subprocess.CompletedProcess:
    """Run training (the test preset, or ``config``) to its end and check the exit status."""
    result = subprocess.run(
        train_args(launcher, out, data, *overrides, config=config),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == expect, f"exit {result.returncode}\n" + result.stdout[-3000:] + result.stderr[-6000:]
    return result


def train_here(out: Path, data: dict, *overrides: str, config: str = TEST_CONFIG) -> Path:
    """A one-process run inside this test process, for tests of what training makes (the
    seconds of imports a fresh process spends are paid once); tests of processes, signals
    and exit statuses use ``train``. What a run sets for its process (the root logger's
    handlers, Accelerate's state, the environment) is put back afterwards. Returns the run
    directory."""
    from accelerate.state import AcceleratorState, GradientState

    from taehv_train.training import taehv_train

    def fresh_accelerate_state() -> None:  # as a new process has it (other tests make Accelerators too)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    root = logging.getLogger()
    handlers, level, environ = root.handlers[:], root.level, dict(os.environ)
    fresh_accelerate_state()
    try:
        return taehv_train.main(training_options(out, data, *overrides, config=config))
    finally:
        for handler in set(root.handlers) - set(handlers):
            handler.close()  # the run's train.log
        root.handlers[:], root.level = handlers, level
        os.environ.clear()
        os.environ.update(environ)
        fresh_accelerate_state()


def refused_here(out: Path, data: dict, *overrides: str, config: str = TEST_CONFIG) -> str:
    """The error line of a start refused in this process (``train_here``): the line the entry
    point prints, and exits 2 with, for a problem the user fixes (the seconds of a process's
    imports paid once; tests of the exit status itself run a process)."""
    from taehv_train.base.errors import USER_ERRORS

    try:
        train_here(out, data, *overrides, config=config)
    except USER_ERRORS as err:
        return f"error: {err}".splitlines()[0]
    raise AssertionError(f"the start with {overrides} was not refused")


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The error line of a run that exited 2: no traceback anywhere."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-4000:]
    assert "Traceback" not in result.stdout + result.stderr
    return next(line for line in result.stderr.splitlines() if "error: " in line)


def start(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start a process in its own session (so it can be signalled as a whole), output to ``log``."""
    return subprocess.Popen(
        args,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def wait_for(condition, timeout: float = 180, what: str = "condition", interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def kill_session(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    os.killpg(process.pid, sig)
    process.wait(timeout=60)


def exit_status(process: subprocess.Popen, timeout: float = 300) -> int:
    """The exit status of ``process``; one still running after ``timeout`` (hung ranks) is
    killed with its whole session and the test fails."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(process)
        raise AssertionError(f"still running after {timeout} s (hung ranks?); killed") from None


def run_dir(out: Path, name: str | None = None) -> Path:
    if name is not None:
        return out / name
    runs = [p for p in out.iterdir() if p.is_dir()]
    assert len(runs) == 1, f"expected exactly one run directory, got {runs}"  # decided once for all ranks
    return runs[0]


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def assert_identical(a: Path, b: Path) -> None:
    """Two safetensors files hold bit-identical tensors."""
    left, right = tensors(a), tensors(b)
    assert left.keys() == right.keys(), (a, b)
    different = [k for k in left if not torch.equal(left[k], right[k])]
    assert not different, f"{len(different)} tensors differ between {a} and {b}, e.g. {different[:3]}"
