"""Process-group set-up shared by training and the latent cache (CPU runs use gloo), and
the command that started a process, for the lines that say how to run it again."""

from __future__ import annotations

import os
import sys
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


def started_command(module: str, argv: list[str]) -> list[str]:
    """The command that runs ``module`` with ``argv`` as this process was started:
    ``python -m module ...``, or under ``accelerate launch``/torchrun (LOCAL_RANK set) the
    launcher, whose options only the user knows."""
    if "LOCAL_RANK" in os.environ:
        return ["accelerate", "launch", "<the same launch options>", "-m", module, *argv]
    return [sys.executable, "-m", module, *argv]
