"""The DataLoader over a clip dataset (an ``EpochDataset``): a shuffle that depends only on
(seed, epoch), workers that leave stop signals to the training process and
end with it, and a worker's ``VideoDataError`` raised again in the training process with
its reason and advice."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import NoReturn

import numpy as np
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from taehv_train.base.errors import VideoDataError
from taehv_train.common.epoch_dataset import EpochDataset
from taehv_train.common.lifeline import watch_parent


class EpochShuffleSampler(Sampler[int]):
    """A permutation that depends only on (seed, dataset.epoch).

    Unlike a RandomSampler whose generator advances with each epoch, a resumed run gets
    the same order for the same epoch, and every rank computes the same permutation
    (Accelerate then gives each rank its share). ``set_epoch`` (called by Accelerate's
    DataLoader wrapper) forwards to the dataset, so the epoch has a single source.
    """

    def __init__(self, dataset: EpochDataset, seed: int):
        self.dataset = dataset
        self.seed = seed

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.dataset.epoch)
        return iter(torch.randperm(len(self.dataset), generator=generator).tolist())


class ShardOrderSampler(Sampler[int]):
    """The epoch's order of clips that lie in tar shards: each training process reads its
    own run of whole shards, shuffled within a window, so reads stay within a few shards at
    a time (sequential on a disk, few objects at once in a bucket).

    Each epoch permutes the shards from (seed, epoch) and cuts their clips, in that order,
    into one run per process of equal length, a whole number of batches; each run is
    shuffled by a shuffle buffer of ``buffer`` clips (the buffer holds clip numbers, not
    clips: it costs no memory) drawn from (seed, epoch, process). The batches are then
    interleaved the way Accelerate deals them out (batch ``k * processes + r`` to process
    ``r``), so process ``r`` gets exactly its run. Each clip comes at most once per epoch;
    fewer than ``processes * batch_size`` are left out of an epoch, at the end of its shard
    order, as a file dataset's last incomplete round of batches is. The order is a pure
    function of (seed, epoch, processes, batch_size, buffer): a resumed run skips the
    batches taken, and a run with other loader workers sees the same order.
    """

    def __init__(self, dataset: EpochDataset, seed: int, batch_size: int, processes: int, buffer: int):
        self.dataset, self.seed = dataset, seed
        self.batch_size, self.processes, self.buffer = batch_size, processes, buffer

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def _run_length(self) -> int:
        return len(self.dataset) // self.processes // self.batch_size * self.batch_size

    def __len__(self) -> int:
        return self._run_length() * self.processes

    def __iter__(self) -> Iterator[int]:
        clips, epoch = self.dataset.clips, self.dataset.epoch
        bounds = np.searchsorted(clips.shard_of, np.arange(len(clips.shards) + 1))  # clips lie in shard order
        shards = np.random.default_rng([self.seed, epoch]).permutation(len(clips.shards))
        order = np.concatenate([np.arange(bounds[s], bounds[s + 1]) for s in shards])
        length = self._run_length()
        runs = [
            buffer_shuffle(
                order[r * length : (r + 1) * length], self.buffer, np.random.default_rng([self.seed, epoch, r])
            )
            for r in range(self.processes)
        ]
        batches = [run.reshape(-1, self.batch_size) for run in runs]
        return iter(np.stack(batches, axis=1).reshape(-1).tolist())


def buffer_shuffle(items: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """``items`` in the order a shuffle buffer of ``size`` gives them (WebDataset's
    ``shuffle``): fill the buffer, then each next item replaces a random one, which comes out."""
    out, buffer = [], []
    for item in items.tolist():
        buffer.append(item)
        if len(buffer) >= size:
            pick = int(rng.integers(len(buffer)))
            buffer[pick], buffer[-1] = buffer[-1], buffer[pick]
            out.append(buffer.pop())
    rng.shuffle(buffer)
    return np.asarray(out + buffer, dtype=np.int64)


def epoch_sampler(
    dataset: EpochDataset, seed: int, batch_size: int, processes: int, shuffle_buffer: int
) -> Sampler[int]:
    """The training order: shard runs for clips in tar shards, else a permutation of all clips."""
    clips = getattr(dataset, "clips", None)
    if clips is not None and clips.ranges is not None:
        return ShardOrderSampler(dataset, seed, batch_size, processes, shuffle_buffer)
    return EpochShuffleSampler(dataset, seed)


def tie_worker_to_parent(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: the worker leaves stop signals to the training process
    and ends with it. A preempted job's SIGTERM, or Ctrl+C, reaches every process of the
    job, workers included; a worker that died of it would crash the training process before
    it can save. So workers ignore SIGINT, and SIGTERM unless it comes from their parent (how
    the DataLoader shuts down a worker that does not stop by itself): it is blocked and taken
    by a thread that checks the sender. A training process killed outright (``kill -9``)
    takes its workers with it (``common.lifeline.watch_parent``), run lock included."""
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_exit_on_sigterm_from, args=(parent,), daemon=True, name="sigterm-from-parent").start()
    watch_parent(parent)


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Hold SIGTERM and SIGINT in this thread while DataLoader workers start: a worker
    inherits the mask when it is forked, so a stop signal sent to the whole job before its
    ``worker_init_fn`` runs stays pending (and is then ignored there) instead of killing
    it; this process takes its own signal once the workers are up."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _exit_on_sigterm_from(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)


class WorkerDataError(ExceptionWrapper):
    """A worker's ``VideoDataError``, handed to the training process in place of the batch.

    An exception raised in a worker reaches the training process as its traceback's text, from
    which the DataLoader builds a new one; this record carries the reason and advice as data
    instead. It is an ``ExceptionWrapper`` because the DataLoader raises any of those that a
    worker hands back (its ``reraise``), in its own iteration: the loaders that Accelerate
    rebuilds from this one (``prepare``, ``skip_first_batches``) raise it too.
    """

    def __init__(self, error: VideoDataError):
        super().__init__((type(error), error, error.__traceback__), where="in a DataLoader worker")
        self.reason, self.advice = error.reason, error.advice

    def reraise(self) -> NoReturn:
        raise self.exc_type(self.reason, self.advice)


class _DataErrorsAsSamples(Dataset):
    """``dataset`` as a worker reads it: a ``VideoDataError`` becomes the sample (a ``WorkerDataError``)."""

    def __init__(self, dataset: EpochDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def __getitem__(self, index: int) -> dict | WorkerDataError:
        try:
            return self.dataset[index]
        except VideoDataError as err:
            return WorkerDataError(err)


def _collate_or_data_error(samples: list[dict | WorkerDataError]) -> dict | WorkerDataError:
    """The samples as one batch, or the ``WorkerDataError`` among them, which the DataLoader raises."""
    errors = [sample for sample in samples if isinstance(sample, WorkerDataError)]
    return errors[0] if errors else default_collate(samples)


def build_dataloader(
    dataset: EpochDataset,
    batch_size: int,
    num_workers: int = 4,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    prefetch_factor: int = 2,
    persistent_workers: bool = True,
    pin_memory: bool = False,
    processes: int = 1,
    shuffle_buffer: int = 1000,
) -> DataLoader:
    """DataLoader over a clip dataset (a ``VideoClipDataset``, or one wrapping it); batches are
    ``{"frames": [N, T, C, H, W], ...}`` (C = 3, or 4 for RGBA).

    Pass it to ``accelerator.prepare`` for rank sharding, and call
    ``dataset.set_epoch(epoch)`` (or the prepared loader's ``set_epoch``) each epoch; clips in
    tar shards are dealt to the ``processes`` in runs (``ShardOrderSampler``). A
    ``VideoDataError`` raised by ``dataset`` comes out of the loader's iteration with its
    reason and advice, with workers or without.
    """
    # Do not call cv2.setNumThreads in a worker_init_fn: in a forked worker it can block
    # forever on the parent's OpenCV thread-pool state. Decoding is already 1 thread/clip.
    # Workers leave SIGTERM/SIGINT to the training process, which stops them itself, and end with it.
    workers_kwargs = {}
    if num_workers > 0:
        workers_kwargs = dict(
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            worker_init_fn=tie_worker_to_parent,
            collate_fn=_collate_or_data_error,
        )
    return DataLoader(
        _DataErrorsAsSamples(dataset) if num_workers > 0 else dataset,
        batch_size=batch_size,
        sampler=epoch_sampler(dataset, seed, batch_size, processes, shuffle_buffer) if shuffle else None,
        num_workers=num_workers,
        drop_last=drop_last,
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(seed),
        **workers_kwargs,
    )
