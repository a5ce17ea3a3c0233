"""Stopping and skipping the same way on every rank.

A rank that skips a backward pass or leaves the loop on its own hangs the others in the
next collective (an NCCL timeout). So every decision here is taken together: each rank
contributes its local flags (a signal arrived, a loss is not finite, a forward pass ran
out of memory, its batch could not be loaded) and all ranks act on the maximum, read once
at the end of the accumulation window (``WindowTrouble``).

A bad micro-batch is not skipped by leaving out its gradient hand-over: its rank still
hands over gradients, NaN ones (``training.loop.step``), so the gradient collectives (DDP
buckets, ZeRO reduce-scatter) happen in the same order everywhere and spread the NaN to
every rank's gradients; the agreed flags then make every rank skip the optimizer step.

A process that dies cannot take part: the others see its collectives fail
(``lost_rank_cause``) and stop with ``EXIT_RANK_LOST``; the launcher names the one that died.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from taehv_train.base.errors import UserError
from taehv_train.common.config import TrainConfig
from taehv_train.training.loop.library_seams import compile_backends, register_compile_backend

logger = logging.getLogger(__name__)
FAULT_KINDS = (
    "nan_loss",
    "oom",
    "oom_copy",
    "oom_backward",
    "oom_step",
    "compile_backward",
    "no_overflow_check",
    "crash_in_save",
    "sigterm",
    "disk_full",
    "slow",
)
# Exit status of a process that lost contact with another process of its run (which died
# or was killed): the launcher (``training.launch``) then reports the one that died.
EXIT_RANK_LOST = 3
# Exit status of a process whose optimizer step ran out of memory (nothing saved since the last checkpoint)
EXIT_OUT_OF_MEMORY = 4
# What gloo and NCCL say in a collective whose peer process is gone
_LOST_RANK_MESSAGES = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
)


def lost_rank_cause(error: BaseException | None) -> str | None:
    """What a collective said when another process of the run went away (``error`` or one
    it was raised from), e.g. "Connection reset by peer"; None for any other error."""
    while error is not None:
        if isinstance(error, RuntimeError):
            found = next((text for text in _LOST_RANK_MESSAGES if text in str(error)), None)
            if found is not None:
                return found
        error = error.__cause__ or error.__context__
    return None


class StopRequest:
    """Remembers SIGTERM/SIGINT instead of dying mid-step; the loop checkpoints and exits
    at the next step boundary. Installed first thing, so a signal during start-up stops the
    run cleanly before its first step.

    One stop often arrives several times: Ctrl+C reaches every process of the terminal's
    group, and the launch script and the launcher pass signals on. A repeat within
    ``REPEAT_WINDOW_S`` is that same request; a later SIGINT (Ctrl+C again) interrupts at once.
    """

    REPEAT_WINDOW_S = 2.0

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._first_at = 0.0

    def install(self) -> StopRequest:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.receive(signum))
        return self

    def receive(self, signum: int) -> None:
        """Take a SIGTERM/SIGINT (from the handler, or replayed when it arrived before ``install``)."""
        if self.signal_name is not None:
            if signum == signal.SIGINT and time.monotonic() - self._first_at > self.REPEAT_WINDOW_S:
                raise KeyboardInterrupt
            return
        self.signal_name = signal.Signals(signum).name
        self._first_at = time.monotonic()
        logger.warning(
            "received %s: will stop at the next step boundary (saving a checkpoint once training has "
            "started); Ctrl+C again to interrupt at once",
            self.signal_name,
        )

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


def agree(flags: list[bool], device: torch.device) -> list[bool]:
    """Element-wise OR of ``flags`` over all ranks (one small all-reduce)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return list(flags)
    tensor = torch.tensor([float(f) for f in flags], device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]


def broadcast_flag(flag: bool, device: torch.device) -> bool:
    """Rank 0's ``flag`` on every rank (decisions such as early stopping are taken once)."""
    return bool(broadcast_numbers([float(flag)], device)[0])


def broadcast_numbers(values: list[float], device: torch.device) -> list[float]:
    """Rank 0's ``values`` on every rank (float64: integers below 2**53 come back exact)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.broadcast(tensor, src=0)
    return tensor.tolist()


class Settled(NamedTuple):
    """What some rank's micro-batches of a window ran into, as every rank reads it."""

    out_of_memory: bool
    data_failed: bool
    stop_requested: bool
    compile_failed: bool  # torch.compile failed on some rank: every rank runs eager from now on
    backward_failed: bool  # a rank's backward pass could not run (a compilation that failed there)
    nonfinite_loss: bool
    nonfinite_gradient: bool

    @property
    def problem(self) -> str | None:
        """Why the window's optimizer step is skipped on every rank (lost data aside)."""
        if self.out_of_memory:
            return "out of memory"
        if self.backward_failed:
            return "torch.compile failed in the backward pass"
        if self.nonfinite_loss:
            return "non-finite loss"
        return "non-finite gradient" if self.nonfinite_gradient else None


def wait_for_device(device: torch.device) -> None:
    """Wait until ``device`` has run what was queued on it (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class WindowTrouble:
    """What this rank's micro-batches of one accumulation window ran into, kept where it was
    found until the window ends: the host knows its own out-of-memory errors, lost data,
    compilation failures and stop signal, the device whether each loss and each gradient was
    finite. ``settle`` agrees them over the ranks in one small all-reduce and reads them: the
    window's one device-to-host read of the step's own, so the host never waits for the
    device in the middle of a window.

    The stop signal is read after the host has waited for the device to finish the window:
    a signal's Python handler runs only once the host is back in Python, so on a GPU, where
    the host queues a window and then waits for it, a signal that arrives during that wait
    stops the run at this window's end rather than one window later."""

    def __init__(self, device: torch.device):
        self.device = device
        self.out_of_memory = self.data_failed = self.compile_failed = self.backward_failed = False
        self.nonfinite_loss = torch.zeros((), dtype=torch.bool, device=device)
        self.nonfinite_gradient = torch.zeros((), dtype=torch.bool, device=device)

    def add_loss(self, loss: torch.Tensor) -> None:
        self.nonfinite_loss = self.nonfinite_loss | ~torch.isfinite(loss.detach())

    def add_gradients(self, gradients: list[torch.Tensor]) -> None:
        """This rank's gradients of one micro-batch, before any reduction: a non-finite one
        makes the reduced window non-finite on every rank."""
        if gradients:
            norm = torch.nn.utils.get_total_norm(gradients, error_if_nonfinite=False, foreach=True)
            self.nonfinite_gradient = self.nonfinite_gradient | ~torch.isfinite(norm)

    def settle(self, stop: StopRequest, grad_norm: torch.Tensor | float | None = None) -> Settled:
        flags = torch.zeros(7, device=self.device)
        flags[5] = self.nonfinite_loss
        flags[6] = self.nonfinite_gradient
        if isinstance(grad_norm, torch.Tensor):
            flags[6] = torch.maximum(flags[6], (~torch.isfinite(grad_norm)).float())
        elif grad_norm is not None and not math.isfinite(grad_norm):
            flags[6] = 1.0
        wait_for_device(self.device)
        host = (self.out_of_memory, self.data_failed, stop.requested, self.compile_failed, self.backward_failed)
        for i, flag in enumerate(host):
            if flag:  # a fill on the device: a tensor made from host values would wait for the device's queue
                flags[i] = 1.0
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        # The one read per window: the host must know whether to step the optimizer, the
        # schedule and the EMA weights, and whether to stop.
        return Settled(*(value > 0 for value in flags.tolist()))


def config_errors(config: TrainConfig) -> list[str]:
    """What is wrong with the fault-handling keys."""
    try:
        FaultPlan.parse(config.fault_injection)
    except UserError as err:
        return [str(err)]
    return []


@dataclass
class FaultPlan:
    """Deliberate faults for testing the recovery paths (config ``fault_injection``).

    Format: ``kind@N[-M][:rank]`` items separated by commas, e.g. ``nan_loss@3:1,oom@5``.
    ``nan_loss`` and ``oom`` hit the forward passes of accumulation windows N..M
    (counted from 1, skipped windows included, so a fault fires once per window),
    ``oom_backward`` their backward passes (raised from inside autograd), ``oom_step`` the
    optimizer step at the end of window N, ``compile_backward`` compiles the model (with
    ``compile=true``) with a backend whose backward compilation fails (N is not used),
    ``no_overflow_check`` switches DeepSpeed's own gradient overflow check off once the engine
    is built (an engine without it; N is not used),
    ``sigterm`` sends SIGTERM to the process at the end of window N (after its last
    backward pass, the latest moment before the ranks agree), ``crash_in_save`` kills the
    process while checkpoint N is being written (after the files, before the manifest),
    ``disk_full`` makes the write of checkpoint N fail as a full disk does (ENOSPC),
    ``oom_copy`` raises an out-of-memory error in the copy of a batch to the device by the
    prefetching thread (``training.data.prefetch``), at the N-th batch this process's
    prefetcher copied since the run (re)started, counted from 1 (on a CPU too, where the
    copy moves nothing), ``slow`` makes windows N..M take twice as long (each sleeps, before
    its optimizer step, as long as its micro-batches took: a machine that slows down).
    Without a rank, every rank is hit.
    """

    faults: set[tuple[str, int, int | None]] = field(default_factory=set)

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        faults = set()
        for item in filter(None, (part.strip() for part in spec.split(","))):
            try:
                kind, rest = item.split("@")
                steps, _, rank = rest.partition(":")
                first, _, last = steps.partition("-")
                faults.update((kind, n, int(rank) if rank else None) for n in range(int(first), int(last or first) + 1))
            except ValueError:
                raise UserError(f"fault_injection item {item!r}: expected kind@N, kind@N-M or kind@N:rank") from None
            if kind not in FAULT_KINDS:
                raise UserError(f"fault_injection kind {kind!r}: expected one of {FAULT_KINDS}")
        return cls(faults)

    def fires(self, kind: str, step: int, rank: int) -> bool:
        return (kind, step, rank) in self.faults or (kind, step, None) in self.faults

    def inject_forward(self, step: int, rank: int, loss: torch.Tensor) -> torch.Tensor:
        """Raise a simulated out-of-memory error or return a NaN loss at ``step``."""
        if self.fires("oom", step, rank):
            raise torch.OutOfMemoryError(f"injected out-of-memory error at step {step} (fault_injection)")
        if self.fires("nan_loss", step, rank):
            return loss * float("nan")
        return loss

    def inject_backward(self, step: int, rank: int, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` whose backward pass raises a simulated out-of-memory error at ``step``."""
        return _RaisesInBackward.apply(loss, step) if self.fires("oom_backward", step, rank) else loss

    def maybe_oom_in_step(self, step: int, rank: int) -> None:
        if self.fires("oom_step", step, rank):
            raise torch.OutOfMemoryError(f"injected out-of-memory error in the optimizer step {step} (fault_injection)")

    def anywhere(self, kind: str, rank: int) -> bool:
        """Whether ``kind`` is injected on ``rank`` at any step."""
        return any(k == kind and r in (None, rank) for k, _, r in self.faults)

    def maybe_oom_in_copy(self, copy: int, rank: int) -> None:
        """Raise an out-of-memory error at this process's ``copy``-th copy of a batch to the device."""
        if self.fires("oom_copy", copy, rank):
            raise torch.OutOfMemoryError(
                f"injected out-of-memory error in the copy of batch {copy} to the device "
                f"(fault_injection oom_copy@{copy})"
            )

    def maybe_signal(self, step: int, rank: int) -> None:
        """Send SIGTERM to this process once, in window ``step``."""
        if self.fires("sigterm", step, rank):
            self.faults -= {("sigterm", step, rank), ("sigterm", step, None)}
            os.kill(os.getpid(), signal.SIGTERM)

    def maybe_slow(self, step: int, rank: int, seconds: float) -> None:
        """Sleep ``seconds`` (what window ``step`` took so far) in window ``step``."""
        if self.fires("slow", step, rank):
            time.sleep(seconds)

    def maybe_fill_disk(self, step: int, rank: int) -> None:
        if self.fires("disk_full", step, rank):
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (fault_injection disk_full@{step})")

    def maybe_crash_in_save(self, step: int, rank: int) -> None:
        if self.fires("crash_in_save", step, rank):
            logger.error("fault_injection: killing the process while checkpoint-%d is being written", step)
            os._exit(9)


class _RaisesInBackward(torch.autograd.Function):
    """Identity whose backward pass raises an out-of-memory error, as a real one would
    part-way through autograd (``FaultPlan.inject_backward``)."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, step: int) -> torch.Tensor:
        ctx.step = step
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise torch.OutOfMemoryError(f"injected out-of-memory error in the backward pass of window {ctx.step}")


def failing_backward_backend(name: str = "taehv_fails_in_backward") -> str:
    """Register (once) a torch.compile backend that compiles forward graphs and fails to
    compile backward graphs, as a backend error at the first backward pass does
    (``compile_backward`` fault); returns its name."""
    if name not in compile_backends():

        def fails(graph, example_inputs):
            raise RuntimeError("injected backward compilation failure (fault_injection compile_backward)")

        register_compile_backend(name, lambda graph, example_inputs: graph, fails)
    return name
