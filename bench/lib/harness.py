"""What every benchmark shares: the shared folder and the published ``taehv.py`` in it,
timing, the machine a report was measured on, and JSON output.

Imports no torch at module level (torch is imported where a function needs it): the test
suite's ``conftest.py`` and benchmarks whose parent process stays free of torch
(bench/bench_inference_memory.py) import this module too.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")
WIDE_VARIANT = "taeltx2_3_wide"  # the one variant the published main branch lacks (its own branch's file)


# -- the shared folder and the published implementation ---------------------------------


def shared_dir() -> Path:
    """The read-only shared folder: ``../shared`` next to the repository, or ``TAEHV_SHARED_DIR``."""
    return Path(os.environ.get("TAEHV_SHARED_DIR", REPO_ROOT.parent / "shared")).resolve()


def published_file(variant: str = "taehv") -> Path:
    """The published ``taehv.py`` that builds ``variant``: the main branch's, or for
    taeltx2_3_wide its own branch's (``taehv_published_wide.py``)."""
    name = "taehv_published_wide.py" if variant == WIDE_VARIANT else "taehv_published.py"
    return shared_dir() / "reference" / name


_MODULES: dict[Path, ModuleType] = {}


def load_published(path: Path) -> ModuleType:
    """The published module at ``path``, imported by path (once per file, never copied)."""
    if path not in _MODULES:
        if not path.is_file():
            sys.exit(f"the published implementation is not at {path} (set TAEHV_SHARED_DIR to the shared/ folder)")
        spec = importlib.util.spec_from_file_location(f"taehv_published_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # torch.compile imports the module of the code it traces by name
        spec.loader.exec_module(module)
        _MODULES[path] = module
    return _MODULES[path]


# -- timing -------------------------------------------------------------------------------


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """(wall seconds, result) of one call of ``fn``. On CUDA, ``evaluation.timing``
    synchronises the device around a call."""
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls after one untimed call."""
    fn()
    return min((timed(fn)[0] for _ in range(repeats)), default=float("inf"))


def time_alternating(
    ours: Callable[[], T], published: Callable[[], T], warmup: int, repeats: int
) -> tuple[list[float], list[float], T, T]:
    """Run times of ``ours`` and ``published``, alternating call by call, and their last outputs."""
    for _ in range(warmup):
        ours()
        published()
    times: tuple[list[float], list[float]] = ([], [])
    outs: list[Any] = [None, None]
    for _ in range(repeats):
        for k, fn in enumerate((ours, published)):
            outs[k] = None  # the previous output is not kept alive during the call
            seconds, outs[k] = timed(fn)
            times[k].append(seconds)
    return times[0], times[1], outs[0], outs[1]


# -- the machine --------------------------------------------------------------------------


def cpu_name() -> str:
    """The processor as Python names it, else the architecture."""
    return platform.processor() or platform.machine()


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def cpus_summary() -> str:
    """The architecture and the logical CPUs, as one line."""
    return f"{platform.machine()}, {os.cpu_count()} CPUs"


def threads_summary(cpu: str | None = None) -> str:
    """``cpu`` (default: the architecture) and torch's intra-op threads, as one line."""
    import torch

    return f"{cpu or platform.machine()}, {torch.get_num_threads()} torch threads"


def proc_status_bytes(key: str) -> int | None:
    """A memory figure of /proc/self/status (VmRSS: now, VmHWM: the peak), None without /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine_info() -> dict:
    """The CPU, its vector capability, Python and the platform, for CPU speed reports."""
    import torch

    return {
        "processor": cpu_name(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "mkldnn": torch.backends.mkldnn.is_available(),
    }


def cuda_name() -> str | None:
    """The current CUDA device's name, None without CUDA."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def device_label(device: torch.device) -> str:
    """The CUDA device's name, or "cpu"."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def command_line(module: str | None = None) -> str:
    """The command that ran this process; with ``module``, as ``python -m module ...``."""
    argv = ["-m", module, *sys.argv[1:]] if module else sys.argv
    return " ".join([Path(sys.executable).name, *argv])


def utc_now() -> str:
    """Now, in UTC, to the second (ISO 8601)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# -- output -------------------------------------------------------------------------------


def print_json(report: object, indent: int = 1, out: Path | None = None) -> str:
    """Print ``report`` as JSON on stdout and, with ``out``, write it there too; returns the text."""
    text = json.dumps(report, indent=indent)
    print(text, flush=True)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return text
