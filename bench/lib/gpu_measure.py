"""What bench/bench_gpu.py's rows share: peak memory on CUDA or the CPU, freeing between
measurements, Dynamo's graph count, failures recorded in their rows, and the device's name.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from bench.lib.harness import cpu_model, cpu_name, proc_status_bytes
from taehv_train.training.loop.monitoring import peak_rss_bytes

CLEAR_REFS = Path("/proc/self/clear_refs")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cpu_peak_method() -> str:
    if CLEAR_REFS.exists():
        return "growth of VmHWM over VmRSS, high-water mark reset before each measurement (/proc/self/clear_refs)"
    return "growth of the process' peak RSS (a high-water mark that cannot be reset here: 0 below earlier peaks)"


class PeakMemory:
    """Peak memory of what runs between ``start()`` and ``mb()``, above what was allocated at ``start()``."""

    def __init__(self, device: torch.device):
        self.device, self.base = device, 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        elif CLEAR_REFS.exists():
            CLEAR_REFS.write_text("5")  # VmHWM := VmRSS
            self.base = proc_status_bytes("VmRSS")
        else:
            self.base = peak_rss_bytes()

    def mb(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20
        return max(peak_rss_bytes() - self.base, 0) / 2**20


def free(device: torch.device) -> None:
    """Release what the last measurement left (run after dropping references)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class GraphCount:
    """Graphs Dynamo compiled since the last ``step()`` (or construction)."""

    def __init__(self):
        self.last = self._now()

    @staticmethod
    def _now() -> int:
        return counters["stats"]["unique_graphs"]

    def step(self) -> int:
        now = self._now()
        new, self.last = now - self.last, now
        return new


def record_failure(row: dict, err: Exception) -> None:
    """A measurement that raised: its error goes into its row and, with the traceback, to stderr;
    the other measurements go on and the command exits with status 1 (``main``)."""
    row["error"] = f"{type(err).__name__}: {err}"[:4000]
    log(
        f"FAILED {json.dumps({k: v for k, v in row.items() if k != 'error'})}:\n"
        + "".join(traceback.format_exception(err))
    )


def check_compiled(row: dict, compiled: bool) -> None:
    """A compiled row that compiled nothing ran eagerly (e.g. Dynamo's recompile limit): refuse it."""
    if compiled and row["graphs_compiled_first_call"] == 0:
        raise RuntimeError(f"compiled row compiled no graph on its first call (it would time eager code): {row}")
    if not compiled and row["graphs_compiled_first_call"] + row["graphs_compiled_timed"]:
        raise RuntimeError(f"eager row compiled graphs: {row}")


def kwargs_text(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def device_name(device: torch.device) -> str:
    """The CUDA device's name, or "cpu: " and the CPU's model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {cpu_model() or cpu_name()}"
