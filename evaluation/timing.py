"""Timing on any device: the device is synchronised around the timed call, so a CUDA
kernel still running is counted, and peak CUDA memory is measured from the call's start.
``inference.py`` and the benchmarks time with these."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: torch.device) -> tuple[T, float, float | None]:
    """(result, seconds, peak MB on CUDA) with the device synchronised around the call."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated(device) - before) / 2**20 if device.type == "cuda" else None
    return out, seconds, peak


def median_seconds(fn: Callable[[], T], device: torch.device, warmup: int = 0, repeats: int = 1) -> tuple[float, T]:
    """(median seconds of ``repeats`` synchronised calls after ``warmup`` untimed ones, the last result)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        out = fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out
