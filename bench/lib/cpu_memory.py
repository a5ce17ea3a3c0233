"""Peak memory of one call of ours or the published model, each in a fresh spawned process:
peak RSS growth (VmHWM, reset through /proc/self/clear_refs where the kernel allows) and
the peak of glibc's bytes in use (mallinfo2) sampled during the call;
bench/bench_speed.py's memory columns.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

import taehv_train.models.taehv as taehv_module
from bench.lib.harness import load_published, proc_status_bytes
from bench.lib.published_model import operation
from taehv_train.models.taehv import TAEHV


def _peak_bytes() -> int:
    peak = proc_status_bytes("VmHWM")
    if peak is None:  # not Linux: the training monitor's fallback (imported only here: it loads accelerate)
        from taehv_train.training.loop.monitoring import peak_rss_bytes

        peak = peak_rss_bytes()
    return peak


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_in_use() -> Callable[[], int] | None:
    """glibc's bytes allocated through malloc and not yet freed (mallinfo2: heap chunks in
    use + mmapped chunks), or None where there is no glibc >= 2.33."""
    try:
        mallinfo2 = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    return lambda: (lambda info: info.uordblks + info.hblkhd)(mallinfo2())


def with_heap_peak(
    fn: Callable[[], torch.Tensor], in_use: Callable[[], int], interval: float = 2e-4
) -> tuple[torch.Tensor, int]:
    """``fn()`` and the peak of ``in_use()`` during it over the value before, sampled every
    ``interval`` s by a thread (torch ops release the GIL): the memory a call really
    allocates, whatever the allocator keeps from earlier calls."""
    base = peak = in_use()
    done = threading.Event()

    def poll() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, in_use())
            time.sleep(interval)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        out = fn()
    finally:
        done.set()
        thread.join()
    return out, max(peak, in_use()) - base


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_worker(config: dict) -> dict:
    """In a fresh process: peak RSS growth of one call over the loaded model and input."""
    torch.set_num_threads(config["threads"])
    taehv_module.SEQUENTIAL_CHUNK_BYTES = config["sequential_chunk_bytes"]
    if config["impl"] == "ours":
        model = TAEHV(variant=config["variant"])
        model.load_state_dict(torch.load(config["checkpoint"], map_location="cpu", weights_only=True))
    else:
        model = load_published(Path(config["published_file"])).TAEHV(checkpoint_path=config["checkpoint"])
    model.eval()
    x = torch.load(config["input"], weights_only=True)
    fn = operation(model, config["impl"] == "published", config["op"], config["mode"] == "parallel", x)
    gc.collect()
    base = proc_status_bytes("VmRSS") or 0
    with torch.inference_mode():
        out = fn()  # warm-up at the same size
        del out
        gc.collect()
        reset = _reset_peak()
        in_use = heap_in_use()
        out, heap = with_heap_peak(fn, in_use) if in_use else (fn(), None)
        peak = _peak_bytes()
    return {
        "peak_mb": (peak - base) / 2**20,
        "heap_mb": None if heap is None else heap / 2**20,
        "baseline_mb": base / 2**20,
        "hwm_reset": reset,
        "output_shape": list(out.shape),
    }


def measure_memory(config: dict) -> dict:
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(memory_worker, config).result()
