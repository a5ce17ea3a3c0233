"""Probing files in worker processes the parent can kill: one file in flight per worker, a
time limit per file, and a worker that crashes on a file replaced, so that no file (a
stalled mount, a decoder stuck in a loop or crashing) stops a folder's probe. Files that
are not regular files (a FIFO, socket or device) are reported without being opened:
opening a FIFO waits for a writer forever. A worker ends with the process that probes
(``kill -9`` of the tool takes its workers with it): through the kernel's parent-death
signal, which comes when the *thread* that forked the worker ends (prctl(2)), so
``probe_all`` is iterated to its end by one thread (the tool's main thread)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections import deque
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import NamedTuple

from taehv_train.common.lifeline import end_with_parent
from taehv_train.common.video.files import BadClipError, check_regular_file
from taehv_train.common.video.probe import probe_video

Job = tuple[Path, str]  # (root, path relative to it)
DEFAULT_PROBE_TIMEOUT = 600.0  # seconds per file: a decoded probe reads 1.5-5 hours of 720p at 300-900 frames/s


class Probe(NamedTuple):
    """The result of probing one file: what decodes (``info``) or why it cannot be used."""

    rel: str
    info: dict | None  # {"full_path", "frames", "fps", "width", "height"}, as probed
    reason: str | None
    retry: bool = False  # a time-out or a crashed worker: probed again on the next run


def _probe(job: Job) -> Probe:
    root, rel = job
    full = (root / rel).resolve()
    try:
        info = probe_video(full)
    except BadClipError as err:
        return Probe(rel, None, str(err))
    return Probe(
        rel,
        {"full_path": str(full), "frames": info.frames, "fps": info.fps, "width": info.width, "height": info.height},
        None,
    )


def _probe_worker(conn: Connection, parent: int) -> None:
    """A probing process: probes the jobs it receives, one at a time, until it gets None;
    ends with ``parent`` (a probe can be stuck in a read or a decoder for good)."""
    end_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the parent's: it ends the workers
    while (job := conn.recv()) is not None:
        conn.send(_probe(job))


class _Worker:
    """One probing process and the job it has in flight (with its start time)."""

    def __init__(self, context: multiprocessing.context.BaseContext):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_probe_worker, args=(child, os.getpid()), daemon=True)
        self.process.start()
        child.close()
        self.rel: str | None = None
        self.started = 0.0

    def start(self, job: Job) -> None:
        self.rel, self.started = job[1], time.monotonic()
        self.conn.send(job)

    def died(self) -> str:
        """The skip reason of the job in flight when the process ended by itself."""
        self.process.join()
        code = self.process.exitcode
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}"
        return f"probe process died ({how})"

    def kill(self) -> None:
        """SIGKILL: a read stuck in the kernel or a decoder loop cannot be interrupted otherwise."""
        self.process.kill()
        self.process.join(timeout=10)
        self.conn.close()

    def stop(self) -> None:
        self.conn.send(None)
        self.process.join(timeout=10)
        self.conn.close()


def probe_all(root: Path, rel_paths: Sequence[str], workers: int, timeout: float) -> Iterator[Probe]:
    """Probe ``rel_paths`` and yield a ``Probe`` per file, in completion order.

    A file that is not a regular file is reported without being opened. The others are
    probed in up to ``workers`` worker processes, one file in flight per worker: a probe
    still running after ``timeout`` seconds has its worker killed and replaced, and a
    worker that dies on a file is replaced; either way the file is reported with the
    reason (marked ``retry``) and probing carries on."""
    pending: deque[Job] = deque()
    for rel in rel_paths:
        try:
            check_regular_file(root / rel)  # from stat alone: opening a FIFO can wait forever
        except BadClipError as err:
            yield Probe(rel, None, str(err))
            continue
        pending.append((root, rel))
    if not pending:
        return
    # fork: a worker starts at once (no re-import of torch and OpenCV), also as a replacement
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    pool: list[_Worker] = []
    try:
        for _ in range(min(workers, len(pending))):
            pool.append(_Worker(context))
            pool[-1].start(pending.popleft())
        while busy := [w for w in pool if w.rel is not None]:
            first_deadline = min(w.started for w in busy) + timeout
            ready = wait([w.conn for w in busy], timeout=max(0.0, first_deadline - time.monotonic()))
            for worker in busy:
                if worker.conn in ready:
                    try:
                        result = worker.conn.recv()
                    except EOFError:  # the process ended without an answer (a decoder crash)
                        result = Probe(worker.rel, None, worker.died(), retry=True)
                elif time.monotonic() - worker.started >= timeout:
                    result = Probe(worker.rel, None, f"timed out after {timeout:g} s", retry=True)
                    worker.kill()
                else:
                    continue
                yield result
                worker.rel = None
                if not worker.process.is_alive():
                    pool[pool.index(worker)] = worker = _Worker(context)
                if pending:
                    worker.start(pending.popleft())
        for worker in pool:
            worker.stop()
    finally:
        for worker in pool:
            if worker.process.is_alive():
                worker.kill()
