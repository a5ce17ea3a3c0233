"""The training loop's scalars (to every tracker: ``training.loop.trackers``), the log line,
the reconstruction strips (TensorBoard) and the profiler.

Loss terms and failure counts are summed as tensors between log steps (no host sync per
step) and averaged across ranks only when logged. What the log step reports about speed:

- ``train/samples_per_second``: clips trained per second of wall time, all ranks;
- ``train/data_wait``: the share of wall time the step waited for a batch that was not
  ready (the prefetching thread and the loader workers should make it ~0);
- ``train/gpu_idle`` (CUDA): the share of wall time the GPU had no training work queued
  (``training.data.cuda_sequence.IdleClock``); validation and checkpoints count as idle, so look at it between them;
- ``train/tflops``: the TAE's training FLOPs (``training.loop.feed.micro_batch_flops``, a
  meta-device count) per second, and ``train/mfu`` that rate over the GPU's dense peak for
  the run's precision (known GPUs only).
"""

from __future__ import annotations

import logging
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator

from taehv_train.common.config import TrainConfig
from taehv_train.training.data.cuda_sequence import IdleClock
from taehv_train.training.loop.feed import micro_batch_flops, peak_flops
from taehv_train.training.loop.trackers import start_trackers, tensorboard_writer

if TYPE_CHECKING:
    from taehv_train.training.loop.step import StepResult

logger = logging.getLogger(__name__)
# the loss log steps a run of a known length aims at, unless log_every is typed: twice the 20 it
# should get at least, so a time budget whose plan is halved midway still logs 20
LOG_POINTS = 40


def log_interval(log_every: int, last_step: int | None, typed: bool) -> int:
    """Steps between two loss log steps: the config's ``log_every``, lowered so that a run
    whose length is known (``last_step``: its step count or a time budget's plan) logs
    about ``LOG_POINTS`` times; a ``log_every`` typed on the command line is kept as typed."""
    if typed or not last_step:
        return log_every
    return max(1, min(log_every, last_step // LOG_POINTS))


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


def speed_line(logs: dict[str, float]) -> str:
    """The log line of a log step: the loss and what the run's speed is made of."""
    parts = [f"loss {logs['train/loss']:.4f}"]
    parts.append(f"{logs['train/samples_per_second']:.2f} clips/s")
    parts.append(f"data wait {logs['train/data_wait']:.0%}")
    if "train/gpu_idle" in logs:
        parts.append(f"GPU idle {logs['train/gpu_idle']:.0%}")
    parts.append(f"{logs['train/tflops']:.3g} TFLOP/s")
    if "train/mfu" in logs:
        parts.append(f"MFU {logs['train/mfu']:.1%}")
    return ", ".join(parts)


class Monitor:
    def __init__(
        self,
        accelerator: Accelerator,
        config: TrainConfig,
        run_dir: Path,
        start_step: int = 0,
        idle: IdleClock | None = None,
        log_every_typed: bool = False,
    ):
        """``log_every_typed``: the command line set ``log_every`` (``log_interval``)."""
        self.accelerator, self.config, self.run_dir = accelerator, config, run_dir
        self.log_every_typed = log_every_typed
        self.idle = idle or IdleClock(accelerator.device)
        self.flops_per_micro_batch = micro_batch_flops(config)
        self.peak_flops = peak_flops(accelerator.device, config.mixed_precision)
        start_trackers(accelerator, config, run_dir, first_start=start_step == 0)
        self._sums: dict[str, torch.Tensor] = {}
        self._count = 0
        self._failures = torch.zeros((), dtype=torch.long)
        self._last_step, self._since = start_step, time.perf_counter()
        self._data_wait = 0.0  # seconds spent waiting for batches since the last log
        self._micro_batches = 0  # trained since the last log (skipped windows included: they computed)
        self.total_failures = 0
        self.last_psnr: float | None = None  # none before the first validation

    def logs_at(self, step: int, last_step: int | None) -> bool:
        """Whether ``step`` is a loss log step (``log_interval``) of a run ending at ``last_step``."""
        return step % log_interval(self.config.log_every, last_step, self.log_every_typed) == 0

    def add_window(self, result: StepResult) -> None:
        """Add an accumulation window (``training.loop.step``): the (finite) loss terms of
        its micro-batches, the seconds this rank waited for them (the workers' prefetching
        should make that ~0) and the clips they had to replace (bad files)."""
        for losses in result.losses:
            for name, value in losses.items():
                self._sums[name] = self._sums.get(name, 0) + value.detach().float()
            self._count += 1
        self._data_wait += result.data_wait
        self._micro_batches += result.micro_batches
        self._failures = self._failures + result.failures  # on the device until logged

    def log_skipped(self, step: int, total: int) -> None:
        """``train/skipped_steps``: steps skipped on every rank so far."""
        self.accelerator.log({"train/skipped_steps": float(total)}, step=step)

    def log_train(self, step: int, lr: float, grad_norm, samples_per_step: int) -> dict[str, float]:
        acc = self.accelerator
        names = sorted(self._sums)
        elapsed = max(time.perf_counter() - self._since, 1e-9)
        idle = self.idle.take_seconds()
        # the loss terms and this rank's speed figures, averaged over ranks
        rates = {
            "train/data_wait": min(self._data_wait / elapsed, 1.0),
            "train/tflops": self._micro_batches * self.flops_per_micro_batch / elapsed / 1e12,
            **({} if idle is None else {"train/gpu_idle": min(idle / elapsed, 1.0)}),
        }
        rate_values = torch.tensor(list(rates.values()), device=acc.device)
        loss_means = [self._sums[n].to(acc.device) / max(self._count, 1) for n in names]
        means = torch.cat([torch.stack(loss_means), rate_values]) if names else rate_values
        values = acc.reduce(means, reduction="mean").tolist()  # a log step's reads: its scalars, ...
        failures = int(acc.reduce(self._failures.to(acc.device), reduction="sum").item())  # ... the bad clips
        self.total_failures += failures
        logs = {f"train/{n}": v for n, v in zip(names, values)}
        logs.update(zip(rates, values[len(names) :]))
        if self.peak_flops is not None:
            logs["train/mfu"] = logs["train/tflops"] * 1e12 / self.peak_flops
        logs.update(
            {
                "train/learning_rate": lr,
                "train/samples_per_second": (step - self._last_step) * samples_per_step / elapsed,
                "train/data_failures": float(self.total_failures),
                **memory_peaks_gb(acc.device),
            }
        )
        if grad_norm is not None:
            logs["train/gradient_norm"] = float(grad_norm)
        acc.log(logs, step=step)
        logger.info("step %d: %s", step, speed_line(logs))
        self._sums, self._count, self._failures, self._data_wait = {}, 0, torch.zeros((), dtype=torch.long), 0.0
        self._micro_batches, self._last_step, self._since = 0, step, time.perf_counter()
        return logs

    def log_validation(self, step: int, metrics: dict, draw: bool) -> None:
        """The validation's scalars, and its reconstruction strip (TensorBoard only) when ``draw``
        (the loop's cadence: every ``image_log_every`` steps, or as a time budget spread them, and the last)."""
        strip = metrics.pop("strip", None)
        self.last_psnr = metrics.get("val/psnr")
        self.accelerator.log(metrics, step=step)
        if self.accelerator.is_main_process:
            logger.info("step %d validation: %s", step, ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
            if strip is not None and draw and (writer := tensorboard_writer(self.accelerator)) is not None:
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
