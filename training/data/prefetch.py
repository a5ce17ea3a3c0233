"""The next batches received, and on CUDA copied to the GPU, while the current step computes.

    batches = Prefetcher(loader, accelerator, progress, depth=config.prefetch_batches,
                         stopping=lambda: stop.requested, batch_timeout=config.batch_timeout, faults=faults)
    item = next(batches)   # a Fetched: the batch (or what stands in its place), where it is in its epoch
    batches.close()

A thread takes the prepared training loader's batches (Accelerate's ``DataLoaderShard``
receives them from the workers; it is prepared without device placement, so they stay on
the host, pinned on CUDA) and keeps up to ``depth`` of them ready. On CUDA the thread
copies each batch to the GPU itself, on a side stream, and the taking thread's stream waits
for that copy on the GPU (``training.data.cuda_sequence``). The copy is ours, not the
loader's, so that an out-of-memory error in it costs one batch (a ``BatchOutOfMemory`` in
its place), not the loader's iterator (a generator that raised is dead).

Where the run is in its data stays with the taking thread: each batch carries its epoch
and its count in the epoch, and ``position`` is set when the step takes it, so a
checkpoint saves what was trained, not what was fetched. The thread holds SIGTERM and
SIGINT for its whole life: the loader workers it forks inherit the held signals (the
run's stop is taken by the main thread), as ``training.data.clip_loader.stop_signals_held`` does for
the main thread. The thread makes no collective call: Accelerate's loader would broadcast
the ranks' RNG states at each epoch's start, which the training accelerator turns off
(``rng_types=[]``; the sampler and the clips' draws are seeded by the epoch).

The taking thread never waits without end. It waits for a batch in short slices, and:

- when the thread has ended (whatever it raised, ``BaseException`` included, from its first
  line on), ``next`` raises a ``RuntimeError`` that says what, in one line;
- when ``stopping()`` is true (a SIGTERM/SIGINT the main thread received while it waited),
  the item is a ``WaitInterrupted``;
- when no batch came within ``batch_timeout`` seconds (a stalled loader worker or storage;
  0: no bound), the item is a ``LoaderFault``, as when the data is gone; meanwhile the
  wait is logged every ``WAIT_LOG_S`` seconds, on every rank;
- a loader worker that died is a ``LoaderFault`` (``training.data.loader_workers``) in
  the place of the batch it owed.

``close`` ends the loader's workers (the run is over; a stalled one would keep the process
from exiting).

Once the data is gone (a ``VideoDataError``) or a wait was interrupted, every later item is
that same error or interruption, counted on through the epoch (an item has the position of
the batch it stands for), so the step can finish its accumulation window in step with the
other ranks (``training.loop.step``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from taehv_train.common.clips import VideoDataError
from taehv_train.training.data.cuda_sequence import DeviceFeed
from taehv_train.training.data.loader_workers import LoaderFault, end_workers
from taehv_train.training.data.loading import DataPosition, batches_until_data_error

logger = logging.getLogger(__name__)
PUT_TIMEOUT_S = 0.1  # how often a thread waiting for room checks whether it was closed
WAIT_SLICE_S = 0.1  # how often the taking thread, waiting for a batch, checks the thread, the stop and the bound
# for the thread to leave the loader when the run ends, before the loader's workers are ended
# (a stalled one never answers)
CLOSE_TIMEOUT_S = 1.0
# for it to leave the loader once the workers are ended (torch's status check: every 5 s)
ENDED_TIMEOUT_S = 10.0
WAIT_LOG_S = 30.0  # how often a rank waiting for its next batch says so


@dataclass(frozen=True)
class WaitInterrupted:
    """Stands in for a batch the taking thread stopped waiting for because a stop was
    requested (a SIGTERM/SIGINT): the step drops the accumulation window on every rank, gives
    its micro-batches back (the run's position returns to the window's start), and the run
    saves and stops as on any signal."""

    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class BatchOutOfMemory:
    """Stands in for a batch whose copy to the GPU ran out of memory (``message`` says which
    and the error's first line): the step treats it as an out-of-memory micro-batch, skipped
    on every rank. The batch is not retried; the thread goes on with the next one."""

    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Fetched:
    """One micro-batch as the step takes it."""

    # a dict of tensors, or what stands in its place: VideoDataError once this rank's data is
    # gone (or no batch came within batch_timeout), WaitInterrupted, BatchOutOfMemory
    batch: dict | VideoDataError | WaitInterrupted | BatchOutOfMemory
    epoch: int = 0
    index: int = 0  # batches of the epoch taken with this one (per process)
    last_in_epoch: bool = False  # an accumulation window ends with it (Accelerate's rule)
    ready: torch.cuda.Event | None = None  # on CUDA: its copy to the GPU has finished


class CopyFaults(Protocol):
    """Deliberate faults in the copies to the device (``training.loop.resilience.FaultPlan``)."""

    def maybe_oom_in_copy(self, copy: int, rank: int) -> None: ...


class _NoFaults:
    def maybe_oom_in_copy(self, copy: int, rank: int) -> None:
        pass


def first_line(error: BaseException) -> str:
    """``Type: first line of the message`` (the type alone for an empty message)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


class Prefetcher(Iterator[Fetched]):
    """The prepared ``loader``'s batches from ``position`` on, epoch after epoch, fetched
    ``depth`` ahead by a thread (module docstring). ``stopping`` says whether a stop was
    requested; ``batch_timeout`` bounds the wait for one batch (seconds, 0: no bound);
    ``faults`` may fail a copy (``oom_copy``); ``feed`` does the copies (on CUDA)."""

    def __init__(
        self,
        loader: DataLoader,
        accelerator: Accelerator,
        position: DataPosition,
        depth: int = 2,
        *,
        stopping: Callable[[], bool] = lambda: False,
        batch_timeout: float = 0.0,
        faults: CopyFaults | None = None,
        feed: DeviceFeed | None = None,
    ):
        if accelerator.num_processes > 1 and accelerator.rng_types:
            raise ValueError(
                "the loader would broadcast RNG states from the prefetching thread at each epoch's start, racing the "
                "training step's collectives: build the Accelerator with rng_types=[]"
            )
        self.loader, self.accelerator, self.position = loader, accelerator, position
        self.stopping, self.batch_timeout = stopping, batch_timeout
        self.faults, self.rank = faults or _NoFaults(), accelerator.process_index
        self.feed = feed or DeviceFeed(accelerator.device)
        self._ready: queue.Queue[Fetched] = queue.Queue(maxsize=max(depth, 1))
        self._closed = threading.Event()
        self._last = (position.epoch, position.batch_in_epoch)  # the position of the last item handed out
        self._standing_in: VideoDataError | WaitInterrupted | None = None  # made here: for every later item
        self._per_epoch: int | None = None  # batches per epoch, as the thread found
        self._died: BaseException | None = None  # what ended the thread
        self._copies = 0  # batches the thread copied (or tried to), for fault_injection's oom_copy
        self._thread = threading.Thread(
            target=self._fetch, args=(position.epoch, position.batch_in_epoch), name="batch-prefetch", daemon=True
        )
        self._thread.start()

    def __next__(self) -> Fetched:
        if self._standing_in is not None:
            return self._take(self._next_slot(self._standing_in))
        started = logged = time.monotonic()
        while True:
            with contextlib.suppress(queue.Empty):
                return self._take(self._ready.get(timeout=WAIT_SLICE_S))
            if time.monotonic() - logged >= WAIT_LOG_S:
                logged = time.monotonic()
                logger.warning(
                    "waiting %.0f s for the next batch from the loader (%s)",
                    logged - started,
                    f"gives up after batch_timeout={self.batch_timeout:g} s" if self.batch_timeout else "no bound",
                )
            if not self._thread.is_alive():
                with contextlib.suppress(queue.Empty):  # what it queued before it ended
                    return self._take(self._ready.get_nowait())
                why = first_line(self._died) if self._died is not None else "it was closed"
                raise RuntimeError(f"the batch-prefetching thread ended without a batch: {why}") from self._died
            if self.stopping():
                return self._stand_in(
                    WaitInterrupted("a stop was requested while this process waited for its next batch")
                )
            if self.batch_timeout and time.monotonic() - started >= self.batch_timeout:
                return self._stand_in(
                    LoaderFault(
                        f"no batch came from the loader within {self.batch_timeout:g} s (batch_timeout): a stalled "
                        "loader worker or storage",
                        "Check the storage and the loader workers (or raise batch_timeout)",
                    )
                )

    def close(self) -> None:
        """Stop the thread and end the loader's workers: the run is over, and a stalled
        worker would otherwise keep the process from exiting (``loader_workers.end_workers``)."""
        self._closed.set()
        with contextlib.suppress(queue.Empty):  # room for a put the thread is waiting on
            while True:
                self._ready.get_nowait()
        self._thread.join(CLOSE_TIMEOUT_S)
        end_workers()
        # a thread still waiting on an ended worker sees its death at the loader's next status check; it must
        # be gone before the interpreter exits: a daemon thread inside torch then aborts the process
        self._thread.join(ENDED_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("the batch-prefetching thread did not end within %.0f s of its workers", ENDED_TIMEOUT_S)

    def _take(self, item: Fetched) -> Fetched:
        """``item`` handed to the step: the run's position moves to it; on CUDA the taking
        stream waits for its copy."""
        self.position.take(item.epoch, item.index)
        self._last = (item.epoch, item.index)
        if isinstance(item.batch, dict):
            self.feed.hand_over(item.batch, item.ready)
        return item

    def _stand_in(self, batch: VideoDataError | WaitInterrupted) -> Fetched:
        """``batch`` in place of the one waited for, and of every later one."""
        self._standing_in = batch
        return self._take(self._next_slot(batch))

    def _next_slot(self, batch: VideoDataError | WaitInterrupted) -> Fetched:
        """``batch`` at the position after the last item handed out."""
        per_epoch = self._per_epoch if self._per_epoch is not None else len(self.loader)
        epoch, index = self._last
        epoch, index = (epoch + 1, 1) if index >= per_epoch else (epoch, index + 1)
        return Fetched(batch, epoch, index, index == per_epoch)

    def _put(self, item: Fetched) -> bool:
        """Queue ``item`` once there is room; False when closed meanwhile."""
        while not self._closed.is_set():
            try:
                self._ready.put(item, timeout=PUT_TIMEOUT_S)
                return True
            except queue.Full:
                continue
        return False

    def _fetch(self, epoch: int, taken: int) -> None:
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
            self._per_epoch = per_epoch = len(self.loader)
            for batch, batch_epoch, index in self._batches(epoch, taken, per_epoch):
                ready = None
                if isinstance(batch, dict):
                    batch, ready = self._copy(batch, batch_epoch, index)
                if not self._put(Fetched(batch, batch_epoch, index, index == per_epoch, ready)):
                    return
        except BaseException as err:  # whatever ends the thread: next() raises it in one line
            self._died = err

    def _copy(self, batch: dict, epoch: int, index: int) -> tuple[dict | BatchOutOfMemory, torch.cuda.Event | None]:
        """``batch`` on the device, or a ``BatchOutOfMemory`` when the device had no room for it."""
        self._copies += 1
        try:
            self.faults.maybe_oom_in_copy(self._copies, self.rank)
            return self.feed.copy(batch)
        except torch.OutOfMemoryError as err:  # the partial copy goes with the error, at the end of this block
            what = BatchOutOfMemory(
                f"out of memory copying batch {index} of epoch {epoch} to {self.feed.device} ({first_line(err)})"
            )
        return what, None

    def _batches(self, epoch: int, taken: int, per_epoch: int) -> Iterator[tuple[dict | VideoDataError, int, int]]:
        """(batch, epoch, batches of the epoch taken with it) from the position on; after a
        VideoDataError, that error again and again, counted on through the epochs."""
        while True:
            self.loader.set_epoch(epoch)  # the sampler's permutation and the dataset's draws follow the epoch
            source = self.accelerator.skip_first_batches(self.loader, taken) if taken else self.loader
            for batch in batches_until_data_error(source):
                taken += 1
                yield batch, epoch, taken
                while isinstance(batch, VideoDataError):
                    epoch, taken = (epoch + 1, 1) if taken == per_epoch else (epoch, taken + 1)
                    yield batch, epoch, taken
            epoch, taken = epoch + 1, 0
