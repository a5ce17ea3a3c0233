"""TensorBoard scalars, image strips and the profiler for the training loop.

Loss terms are summed as tensors between log steps (no host sync per step) and averaged
across ranks only when logged.
"""

from __future__ import annotations

import logging
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator

from common.config import TrainConfig, below

if TYPE_CHECKING:
    from training.loop.step import StepResult

logger = logging.getLogger(__name__)
HPARAM_TYPES = (int, float, str, bool)


def problems(config: TrainConfig) -> list[str]:
    """What is wrong with the logging and profiling keys."""
    return below(config, ("log_every", "validation_every"), 1) + below(config, ("image_log_every", "profile_steps"), 0)


def tensorboard_hparams(config: TrainConfig) -> dict:
    """Only the value types TensorBoard's hparams accept (others raise ValueError there)."""
    return {k: v for k, v in config.to_dict().items() if isinstance(v, HPARAM_TYPES)}


def peak_rss_bytes() -> int:
    """This process' peak resident memory. Read from /proc (VmHWM) where possible:
    ``ru_maxrss`` keeps the high-water mark of the process that exec'd us (a big parent
    makes every child look big)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:  # not Linux: the rusage figure is the best available
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_peaks_gb(device: torch.device) -> dict[str, float]:
    """The peaks worth watching, each under a tag that says which memory it is: the
    process' peak RSS (host memory, on every device; what a CPU run fills) and, on a GPU,
    the peak memory allocated there."""
    peaks = {"train/host_memory_gb": peak_rss_bytes() / 2**30}
    if device.type == "cuda":
        peaks["train/gpu_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    return peaks


class Monitor:
    def __init__(self, accelerator: Accelerator, config: TrainConfig, run_dir: Path, start_step: int = 0):
        self.accelerator, self.config, self.run_dir = accelerator, config, run_dir
        # One TensorBoard run per training run: Accelerate's own hyperparameter logging writes into a new
        # time-stamped folder at every start (TensorBoard shows each as another run), so the hyperparameters go
        # into the run's folder itself, once, at its first start.
        accelerator.init_trackers("logs")
        if accelerator.is_main_process and start_step == 0:
            writer = accelerator.get_tracker("tensorboard", unwrap=True)
            writer.add_hparams(tensorboard_hparams(config), {}, run_name=".")
        self._sums: dict[str, torch.Tensor] = {}
        self._count = 0
        self._failures = torch.zeros((), dtype=torch.long)
        self._last_step, self._since = start_step, time.perf_counter()
        self._data_wait = 0.0  # seconds spent waiting for batches since the last log
        self.total_failures = 0
        self.last_psnr: float | None = None  # none before the first validation

    def add_window(self, result: StepResult) -> None:
        """Add an accumulation window (``training.loop.step``): the (finite) loss terms of
        its micro-batches, the seconds this rank waited for them (the workers' prefetching
        should make that ~0) and the clips they had to replace (bad files)."""
        for losses in result.losses:
            for name, value in losses.items():
                self._sums[name] = self._sums.get(name, 0) + value.detach().float()
            self._count += 1
        self._data_wait += result.data_wait
        self._failures += result.failures.sum().cpu()

    def log_skipped(self, step: int, total: int) -> None:
        """``train/skipped_steps``: steps skipped on every rank so far."""
        self.accelerator.log({"train/skipped_steps": float(total)}, step=step)

    def log_train(self, step: int, lr: float, grad_norm, samples_per_step: int) -> dict[str, float]:
        acc = self.accelerator
        names = sorted(self._sums)
        elapsed = time.perf_counter() - self._since
        # the loss terms and this rank's share of wall time spent waiting for data, averaged over ranks
        data_wait = torch.tensor(min(self._data_wait / max(elapsed, 1e-9), 1.0), device=acc.device)
        means = torch.stack([*(self._sums[n].to(acc.device) / max(self._count, 1) for n in names), data_wait])
        *means, data_wait = acc.reduce(means, reduction="mean").tolist()
        failures = int(acc.reduce(self._failures.to(acc.device), reduction="sum").item())
        self.total_failures += failures
        logs = {f"train/{n}": float(v) for n, v in zip(names, means)}
        logs.update(
            {
                "train/data_wait": data_wait,
                "train/learning_rate": lr,
                "train/samples_per_second": (step - self._last_step) * samples_per_step / max(elapsed, 1e-9),
                "train/data_failures": float(self.total_failures),
                **memory_peaks_gb(acc.device),
            }
        )
        if grad_norm is not None:
            logs["train/gradient_norm"] = float(grad_norm)
        acc.log(logs, step=step)
        self._sums, self._count, self._failures, self._data_wait = {}, 0, torch.zeros((), dtype=torch.long), 0.0
        self._last_step, self._since = step, time.perf_counter()
        return logs

    def log_validation(self, step: int, metrics: dict, last: bool) -> None:
        """The validation's scalars; its reconstruction strip every ``image_log_every`` steps and at the ``last``
        step."""
        strip = metrics.pop("strip", None)
        self.last_psnr = metrics.get("val/psnr")
        self.accelerator.log(metrics, step=step)
        if self.accelerator.is_main_process:
            logger.info("step %d validation: %s", step, ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
            every = self.config.image_log_every
            if strip is not None and ((every and step % every == 0) or last):
                writer = self.accelerator.get_tracker("tensorboard", unwrap=True)
                writer.add_image("val/reconstruction", strip, step, dataformats="CHW")

    def profiler(self) -> torch.profiler.profile | None:
        """A torch profiler over the first ``profile_steps`` steps, trace in run_dir/profile."""
        if not self.config.profile_steps:
            return None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        trace_dir = self.run_dir / "profile"
        prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=1, warmup=1, active=self.config.profile_steps, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(trace_dir)),
            record_shapes=True,
            profile_memory=True,
        )
        prof.start()
        logger.info("profiling %d steps into %s", self.config.profile_steps, trace_dir)
        return prof
