"""The DataLoader over a clip dataset: an epoch counter the workers share, a shuffle that
depends only on (seed, epoch), workers that leave stop signals to the training process and
end with it, and a worker's ``VideoDataError`` raised again in the training process with
its reason and advice."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import NoReturn

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from taehv_train.common.errors import VideoDataError
from taehv_train.common.lifeline import watch_parent


def shared_epoch() -> torch.Tensor:
    """An epoch counter in shared memory, so that ``set_epoch`` reaches persistent DataLoader workers."""
    return torch.zeros((), dtype=torch.int64).share_memory_()


class EpochDataset(Dataset):
    """A dataset whose random draws follow the epoch (``self._epoch``, made by ``shared_epoch``)."""

    _epoch: torch.Tensor

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's random draws; call before iterating each epoch."""
        self._epoch.fill_(epoch)


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
) -> DataLoader:
    """DataLoader over a clip dataset (a ``VideoClipDataset``, or one wrapping it); batches are
    ``{"frames": [N, T, C, H, W], ...}`` (C = 3, or 4 for RGBA).

    Pass it to ``accelerator.prepare`` for rank sharding, and call
    ``dataset.set_epoch(epoch)`` (or the prepared loader's ``set_epoch``) each epoch. A
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
        sampler=EpochShuffleSampler(dataset, seed) if shuffle else None,
        num_workers=num_workers,
        drop_last=drop_last,
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(seed),
        **workers_kwargs,
    )
