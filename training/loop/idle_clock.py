"""How long the GPU had no training work queued, measured with CUDA events.

The step pauses the clock where the host stops queueing work (at a window's end, before it
waits for a batch or reads a result) and resumes it where it queues again; the monitor
reports the sum over each log interval as ``train/gpu_idle``.
"""

from __future__ import annotations

import torch


class IdleClock:
    """Seconds the GPU had no training work queued, from CUDA events (nothing to measure on
    a CPU). ``pause()`` where the host stops queueing work (at a window's end, before
    waiting for a batch or reading a result), ``resume()`` where it queues again: the pause
    event completes when the GPU runs out of work, the resume event as soon as it is queued,
    so the time between them is the GPU's idle time (none when the host came back first)."""

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda"
        self._paused: torch.cuda.Event | None = None
        self._gaps: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
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
