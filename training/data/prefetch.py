"""The next batches received, and on CUDA copied to the GPU, while the current step computes.

    batches = Prefetcher(loader, accelerator, progress, depth=config.prefetch_batches)
    item = next(batches)   # a Fetched: the batch, where it is in its epoch; progress updated
    batches.close()

A thread takes the prepared training loader's batches (Accelerate's ``DataLoaderShard``
receives them from the workers and copies them to the device) and keeps up to ``depth``
of them ready. On CUDA the thread works on a side stream: the loader's ``non_blocking``
copies from pinned memory run there, an event marks their end, and the taking thread's
stream waits for that event on the GPU (the host does not wait) and marks the batch's
tensors as used by that stream (``record_stream``), so that the caching allocator does not
hand their memory out while the step still reads it.

Where the run is in its data stays with the taking thread: each batch carries its epoch
and its count in the epoch, and ``position`` is set when the step takes it, so a
checkpoint saves what was trained, not what was fetched. The thread holds SIGTERM and
SIGINT for its whole life: the loader workers it forks inherit the held signals (the
run's stop is taken by the main thread), as ``common.clip_loader.stop_signals_held`` does for
the main thread. The thread makes no collective call: Accelerate's loader would broadcast
the ranks' RNG states at each epoch's start, which the training accelerator turns off
(``rng_types=[]``; the sampler and the clips' draws are seeded by the epoch).

Once the data is gone (a ``VideoDataError``), every later item is that error, counted on
through the epoch, so the step can finish its accumulation window in step with the other
ranks (``training.loop.step``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from common.clips import VideoDataError
from training.data.loading import DataPosition, batches_until_data_error

logger = logging.getLogger(__name__)
PUT_TIMEOUT_S = 0.1  # how often a thread waiting for room checks whether it was closed
CLOSE_TIMEOUT_S = 60.0  # for the batch being received when the run ends


@dataclass(frozen=True)
class Fetched:
    """One micro-batch as the step takes it."""

    batch: dict | VideoDataError  # the error in its place once this rank's data is gone
    epoch: int = 0
    index: int = 0  # batches of the epoch taken with this one (per process)
    last_in_epoch: bool = False  # an accumulation window ends with it (Accelerate's rule)
    ready: torch.cuda.Event | None = None  # on CUDA: its copy to the GPU has finished


@dataclass(frozen=True)
class _Raised:
    error: BaseException  # what the thread raised, raised again where the batch is taken


class Prefetcher(Iterator[Fetched]):
    """The prepared ``loader``'s batches from ``position`` on, epoch after epoch, fetched
    ``depth`` ahead by a thread (module docstring)."""

    def __init__(self, loader: DataLoader, accelerator: Accelerator, position: DataPosition, depth: int = 2):
        if accelerator.num_processes > 1 and accelerator.rng_types:
            raise ValueError(
                "the loader would broadcast RNG states from the prefetching thread at each epoch's start, racing the "
                "training step's collectives: build the Accelerator with rng_types=[]"
            )
        self.loader, self.accelerator, self.position = loader, accelerator, position
        self.device = accelerator.device
        self._ready: queue.Queue[Fetched | _Raised] = queue.Queue(maxsize=max(depth, 1))
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._fetch, args=(position.epoch, position.batch_in_epoch), name="batch-prefetch", daemon=True
        )
        self._thread.start()

    def __next__(self) -> Fetched:
        item = self._ready.get()
        if isinstance(item, _Raised):
            raise item.error
        self.position.epoch, self.position.batch_in_epoch = item.epoch, item.index
        if item.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(item.ready)
            if isinstance(item.batch, dict):
                for value in item.batch.values():
                    if isinstance(value, torch.Tensor) and value.is_cuda:
                        value.record_stream(stream)
        return item

    def close(self) -> None:
        """Stop the thread (it finishes the batch it is receiving) and let the loader go."""
        self._closed.set()
        with contextlib.suppress(queue.Empty):  # room for a put the thread is waiting on
            while True:
                self._ready.get_nowait()
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():  # a daemon thread: it cannot keep the process alive
            logger.warning("the batch-prefetching thread is still waiting for a loader worker; leaving it behind")

    def _put(self, item: Fetched | _Raised) -> bool:
        """Queue ``item`` once there is room; False when closed meanwhile."""
        while not self._closed.is_set():
            try:
                self._ready.put(item, timeout=PUT_TIMEOUT_S)
                return True
            except queue.Full:
                continue
        return False

    def _fetch(self, epoch: int, taken: int) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        per_epoch = len(self.loader)
        try:
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                for batch, batch_epoch, index in self._batches(epoch, taken, per_epoch):
                    ready = None
                    if side is not None and isinstance(batch, dict):
                        ready = torch.cuda.Event()
                        ready.record(side)
                    if not self._put(Fetched(batch, batch_epoch, index, index == per_epoch, ready)):
                        return
        except Exception as err:  # not swallowed: raised again where the batch is taken
            self._put(_Raised(err))

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
