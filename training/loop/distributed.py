"""Process-group set-up shared by training and the latent cache (CPU runs use gloo), and
the command that started a process, for the lines that say how to run it again."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta

import torch
from accelerate import PartialState
from torch.distributed.constants import default_pg_timeout

from taehv_train.training.loop.library_seams import forgo_deepspeed_shm_kernel

# what a rank that gave up waiting for its batch may still take to reach the window's agreement
COLLECTIVE_MARGIN_S = 600.0


def process_group_backend() -> str | None:
    """gloo for multi-process runs without CUDA (NCCL needs GPUs); Accelerate's default otherwise."""
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return "gloo" if distributed and not torch.cuda.is_available() else None


def collective_timeout(batch_timeout: float) -> timedelta:
    """How long a collective waits for the other ranks: past ``batch_timeout`` (a rank
    whose loader stalled gives up on its batch then, finishes its window and joins the
    agreement, ``training.data.prefetch``) by ``COLLECTIVE_MARGIN_S``, and never below
    torch's default (NCCL's own is shorter: the ranks waiting for a stalled one would die
    of it first)."""
    return max(default_pg_timeout, timedelta(seconds=batch_timeout + COLLECTIVE_MARGIN_S))


def skip_unused_deepspeed_kernels() -> None:
    """Under a DeepSpeed launch without CUDA, before its process group starts: DeepSpeed's CPU
    backend would compile a kernel that training never calls (``forgo_deepspeed_shm_kernel``)."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and not torch.cuda.is_available():
        forgo_deepspeed_shm_kernel()


def process_state(batch_timeout: float = 0.0) -> PartialState:
    """Accelerate's process state (the process group is made by the first call, with
    ``collective_timeout(batch_timeout)``). Several processes without CUDA need ``cpu=True``
    as well as gloo: otherwise (``accelerate launch --multi_gpu`` with ACCELERATE_USE_CPU, or
    torchrun on CPU) Accelerate counts the ranks but its barriers do nothing."""
    skip_unused_deepspeed_kernels()
    backend = process_group_backend()
    cpu = backend == "gloo" or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    return PartialState(cpu=cpu, timeout=collective_timeout(batch_timeout), **({"backend": backend} if backend else {}))


@contextlib.contextmanager
def exit_without_teardown() -> Iterator[None]:
    """Around the entry point of a process of a multi-process run (WORLD_SIZE > 1): its
    exit does what every exit does first, as ``Py_FinalizeEx`` (CPython's
    Python/pylifecycle.c) does it: threads that are not daemons are joined and the exit
    handlers run (logging, TensorBoard, multiprocessing, temporary files); then the process
    ends with its status, without the interpreter's teardown. Process groups outlive
    ``destroy_process_group`` while anything holds them (DeepSpeed's engine does, through
    the hooks it leaves on the parameters), so gloo's worker threads are still running in
    that teardown, and one that drops a tensor then needs the GIL of an interpreter going
    away: a process that ended cleanly aborts ("terminate called without an active
    exception", pytorch/pytorch#190489) and the launcher reports a dead rank. A crash (an
    exception other than ``SystemExit``) ends as Python ends it, with its traceback."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        yield
        return
    status = 0
    try:
        yield
    except SystemExit as ended:
        if ended.code is not None and not isinstance(ended.code, int):
            print(ended.code, file=sys.stderr)  # as the interpreter reports sys.exit("message")
        status = ended.code if isinstance(ended.code, int) else 0 if ended.code is None else 1
    threading._shutdown()  # the interpreter's first step at exit: threads that are not daemons
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def started_command(module: str, argv: list[str]) -> list[str]:
    """The command that runs ``module`` with ``argv`` as this process was started:
    ``python -m module ...``, or under ``accelerate launch``/torchrun (LOCAL_RANK set) the
    launcher, whose options only the user knows."""
    if "LOCAL_RANK" in os.environ:
        return ["accelerate", "launch", "<the same launch options>", "-m", module, *argv]
    return [sys.executable, "-m", module, *argv]
