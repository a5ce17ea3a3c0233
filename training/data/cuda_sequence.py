"""The order of the training's work on a CUDA GPU, kept by streams and events, never by the host waiting.

Two threads queue work on the GPU: the prefetching thread (``training.data.prefetch``)
copies each batch there, and the training thread runs the step on it.

- ``DeviceFeed.copy`` (prefetching thread): the batch's tensors are copied from pinned host
  memory with ``non_blocking=True`` on a side stream, and an event is recorded on that
  stream after the copies;
- ``DeviceFeed.hand_over`` (training thread, before the step sees the batch): the training
  thread's current stream waits for that event on the GPU (the host does not wait), and
  each tensor of the batch is marked as used by that stream (``record_stream``), so that the
  caching allocator does not give its memory to the side stream's next copies while the
  step still reads it;
- ``IdleClock`` (training thread): events recorded where the host stops queueing training
  work and where it queues again; the time between them is the GPU's idle time.

Every ``torch.cuda`` call made here goes through ``CudaApi``, so a test on a CPU drives this
code with a fake that records the calls and checks their order (``tests/test_prefetch.py``).
On a CPU (a device whose type is not "cuda") none of it runs: the batch already is where
the step reads it, and there is no idle time to measure.
"""

from __future__ import annotations

import contextlib

import torch


class CudaApi:
    """The ``torch.cuda`` calls the sequencing makes, and nothing else: the one seam a test
    replaces. The events and streams it returns are used through their own methods
    (``event.record(stream)``, ``stream.wait_event(event)``, ``event.synchronize()``,
    ``start.elapsed_time(end)``)."""

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def use_stream(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager:
        """Work queued inside goes to ``stream`` (this thread's current stream meanwhile)."""
        return torch.cuda.stream(stream)

    def event(self, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    def copy(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``tensor`` on ``device``, queued on the current stream (asynchronous from pinned memory)."""
        return tensor.to(device, non_blocking=True)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)


class DeviceFeed:
    """Batches (flat dicts; their tensors are moved, other values kept) copied to ``device``
    by the thread that fetches them, and handed to the thread that trains on them."""

    def __init__(self, device: torch.device, api: CudaApi | None = None):
        self.device, self.api = device, api or CudaApi()
        self.enabled = device.type == "cuda"
        self._side: torch.cuda.Stream | None = None  # made by the first copy, in the fetching thread

    def copy(self, batch: dict) -> tuple[dict, torch.cuda.Event | None]:
        """``batch`` on the device and the event that marks the end of its copy (None where
        nothing is copied). Raises ``torch.OutOfMemoryError`` when the device has no room; the
        tensors copied so far go with the exception."""
        if not self.enabled:
            return batch, None
        if self._side is None:
            self._side = self.api.stream(self.device)
        with self.api.use_stream(self._side):
            copied = {
                key: self.api.copy(value, self.device) if isinstance(value, torch.Tensor) else value
                for key, value in batch.items()
            }
            ready = self.api.event()
            ready.record(self._side)
        return copied, ready

    def hand_over(self, batch: dict, ready: torch.cuda.Event | None) -> None:
        """Called by the thread that takes ``batch``, before it queues work on it: its stream
        waits for the copy on the GPU, and owns the batch's memory from then on."""
        if ready is None:
            return
        stream = self.api.current_stream(self.device)
        stream.wait_event(ready)
        for value in batch.values():
            if isinstance(value, torch.Tensor):
                self.api.record_stream(value, stream)


class IdleClock:
    """Seconds the GPU had no training work queued, from CUDA events (nothing to measure on
    a CPU). ``pause()`` where the host stops queueing work (at a window's end, before
    waiting for a batch or reading a result), ``resume()`` where it queues again: the pause
    event completes when the GPU runs out of work, the resume event as soon as it is queued,
    so the time between them is the GPU's idle time (none when the host came back first).
    The monitor reports the sum over each log interval as ``train/gpu_idle``."""

    def __init__(self, device: torch.device, api: CudaApi | None = None):
        self.enabled = device.type == "cuda"
        self.api = api or CudaApi()
        self._paused: torch.cuda.Event | None = None
        self._gaps: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _event(self) -> torch.cuda.Event:
        event = self.api.event(timing=True)
        event.record()  # on the current stream: after the work queued so far
        return event

    def pause(self) -> None:
        if self.enabled and self._paused is None:
            self._paused = self._event()

    def resume(self) -> None:
        if self._paused is not None:
            self._gaps.append((self._paused, self._event()))
            self._paused = None

    def take_seconds(self) -> float | None:
        """The idle seconds of the gaps closed since the last call; None on a CPU. Waits for
        the last gap's end to reach the GPU (called at log steps)."""
        if not self.enabled:
            return None
        gaps, self._gaps = self._gaps, []
        if gaps:
            gaps[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in gaps) / 1000
