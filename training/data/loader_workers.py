"""The DataLoader's worker processes as the training process sees them: what a worker's
death means for the run, and ending the workers of a loader the run leaves behind.

A worker that dies (``kill -9``, the kernel's out-of-memory killer, a crash in a decoder)
makes the loader raise ``RuntimeError("DataLoader worker (pid(s) N) exited unexpectedly")``
in the thread that receives its batches, after the loader has reaped it: only the loader's
process records know how it ended. ``worker_death`` turns that error into a
``LoaderFault`` (a ``VideoDataError``: the run saves its last step and stops with one line
and the resume command, as when the data goes away).

A worker that stalls (stopped, or stuck in a hung storage read) never answers: neither the
loader's shutdown nor the interpreter's exit (``multiprocessing`` joins its children) would
end. ``end_workers`` ends them at the end of the run, with SIGKILL for those that do not
take the parent's SIGTERM (``training.data.clip_loader.tie_worker_to_parent``).
"""

from __future__ import annotations

import multiprocessing
import signal
import time
from types import TracebackType

from taehv_train.base.errors import VideoDataError

END_GRACE_S = 1.0  # for a worker to take its parent's SIGTERM before SIGKILL ends it


class LoaderFault(VideoDataError):
    """The loader, not the data, failed: a worker died, or no batch came within
    ``batch_timeout`` (``training.data.prefetch``). The batch it owed is made again by the
    resumed run."""


def end_workers(grace: float = END_GRACE_S) -> None:
    """End this process's DataLoader workers, its only ``multiprocessing`` children while it
    trains (the probe processes of ``make_annotations`` are gone by then): SIGTERM (a worker
    exits at once on its parent's), then SIGKILL for those still there after ``grace``
    seconds (stopped or stuck workers), so that the loader's and the interpreter's own
    waits for them return."""
    workers = multiprocessing.active_children()
    for worker in workers:
        worker.terminate()
    deadline = time.monotonic() + grace
    for worker in workers:
        worker.join(max(deadline - time.monotonic(), 0.0))
        if worker.is_alive():
            worker.kill()
            worker.join()


def how_it_ended(exitcode: int) -> str:
    """A worker's end in words: the signal that killed it, or its exit status."""
    if exitcode >= 0:
        return f"exited with status {exitcode}"
    sig = signal.Signals(-exitcode)
    cause = ", likely out of memory (the kernel's OOM killer, see dmesg) or a kill -9" if sig == signal.SIGKILL else ""
    return f"was killed by signal {-exitcode} ({sig.name}){cause}"


def worker_death(error: Exception) -> LoaderFault | None:
    """The ``LoaderFault`` that ``error`` (raised by the loader's iteration) stands for,
    naming each dead worker and how it ended; None when no worker of the loader died.

    The loader says "exited unexpectedly" once it has seen the death; a batch being received
    from a worker as it dies fails first with the broken connection (``ConnectionResetError``,
    ``EOFError``) while the worker may not have ended yet: its end is waited for, at most
    ``END_GRACE_S`` seconds in all."""
    workers = _workers_seen_by(error.__traceback__)
    deadline = time.monotonic() + END_GRACE_S
    for worker in workers:
        worker.join(max(deadline - time.monotonic(), 0.0))
    dead = [(worker.pid, worker.exitcode) for worker in workers if worker.exitcode not in (None, 0)]
    if not dead:
        return None
    what = "; ".join(f"loader worker pid {pid} {how_it_ended(code)}" for pid, code in dead)
    return LoaderFault(
        what,
        "If memory ran out, lower dataloader_num_workers, frame_cache_mb or prefetch_factor",
    )


def _workers_seen_by(trace: TracebackType | None) -> list[multiprocessing.Process]:
    """The worker processes of the loader iterator that raised along ``trace`` (its frames'
    ``self``), whose records hold how each ended."""
    while trace is not None:
        workers = getattr(trace.tb_frame.f_locals.get("self"), "_workers", None)
        if isinstance(workers, list):
            return workers
        trace = trace.tb_next
    return []
