"""The training loop: each pass trains one accumulation window, counts it, and does what
the time budget says follows the step (``TimeBudget.after_step``): log, validate, let the
budget plan, checkpoint, end. ``TrainingRun`` holds what the loop and the end of the run
share, and does the two things beside the steps: validating and checkpointing.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from taehv_train.common.clips import VideoClipDataset, VideoDataError
from taehv_train.common.config import TrainConfig
from taehv_train.common.reference_vae import ReferenceVAE
from taehv_train.training.data.prefetch import Prefetcher
from taehv_train.training.loop.best_model import BestTracker
from taehv_train.training.loop.expectations import warn_if_short
from taehv_train.training.loop.monitoring import Monitor
from taehv_train.training.loop.progress import Progress
from taehv_train.training.loop.resilience import FaultPlan, broadcast_flag
from taehv_train.training.loop.step import OUT_OF_MEMORY_ADVICE, StepResult, TrainStep
from taehv_train.training.loop.time_budget import AfterStep, TimeBudget
from taehv_train.training.loop.validation import ValidationDataError, validate
from taehv_train.training.state.checkpoints import save_checkpoint
from taehv_train.training.state.trained_weights import export_best_model

logger = logging.getLogger("taehv_train")


@dataclass
class TrainingRun:
    """What the loop and the end of the run share, and the two things done beside the
    steps: validating (best model, early stopping) and checkpointing."""

    config: TrainConfig
    run_dir: Path
    train_step: TrainStep
    progress: Progress
    tracker: BestTracker
    monitor: Monitor
    faults: FaultPlan
    val_set: VideoClipDataset | None
    ref_vae: ReferenceVAE | None
    data: dict[str, dict]  # the clips read at this start (training.state.run_data), for a resume to compare

    def checkpoint(self) -> Path:
        """Save the full training state at the current step (every rank calls it)."""
        trainer_state = {
            "progress": asdict(self.progress),
            "validation_history": self.tracker.history,
            "best_model_since": self.tracker.since,
            "config": self.config.to_dict(),
            "data": self.data,
        }
        return save_checkpoint(
            self.train_step.objects,
            self.run_dir / "checkpoints",
            self.progress.step,
            self.config.checkpoints_total_limit,
            trainer_state,
            self.faults,
        )

    def validate(self, draw: bool) -> bool:
        """Validate the EMA weights at the current step (its reconstruction strip to
        TensorBoard when ``draw``), keep the best model; True when early stopping says stop
        (decided on rank 0, obeyed by all). ValidationDataError, on every rank together,
        when the validation clips went away."""
        config, train_step, step = self.config, self.train_step, self.progress.step
        acc = train_step.accelerator
        with train_step.averaged_weights():
            metrics = validate(
                acc, train_step.unwrapped_model, self.val_set, config, self.ref_vae, train_step.input_dtype
            )
        self.monitor.log_validation(step, metrics, draw)
        train_step.model.train()
        scalars = {k: v for k, v in metrics.items() if isinstance(v, float)}
        if self.tracker.update(step, scalars):
            export_best_model(
                acc,
                train_step.model,
                train_step.ema,
                self.run_dir,
                {
                    "step": step,
                    "metric": config.best_metric,
                    "value": scalars[config.best_metric],
                    "metrics": scalars,
                    "variant": train_step.unwrapped_model.variant,
                    "ema": train_step.ema is not None,
                    "config_file": config.config_file,
                },
                train_step.objects.frozen,
            )
            logger.info(
                "new best %s=%.4f at step %d: saved %s",
                config.best_metric,
                scalars[config.best_metric],
                step,
                self.run_dir / "best_model",
            )
        if acc.is_main_process:
            self.tracker.write_history(self.run_dir)
        return broadcast_flag(self.tracker.should_stop, acc.device)

    def skipped(self, result: StepResult) -> str | None:
        """A window skipped on every rank: said and logged; why the run stops, if it does."""
        progress = self.progress
        logger.warning(
            "step %d skipped on every rank: %s (%d in a row, %d in total)%s",
            progress.step + 1,
            result.skip_reason,
            progress.consecutive_skips,
            progress.skipped_steps,
            f"; if it recurs, {OUT_OF_MEMORY_ADVICE}" if result.skip_reason == "out of memory" else "",
        )
        self.monitor.log_skipped(progress.step, progress.skipped_steps)
        too_many = progress.consecutive_skips >= self.config.max_consecutive_skipped_steps
        return "skipped" if too_many else "signal" if result.stop_requested else None

    def log(self, result: StepResult, after: AfterStep, budget: TimeBudget, progress_bar: tqdm) -> None:
        """The step's training scalars at the logging interval and at the run's last step."""
        if not (self.monitor.logs_at(after.step, budget.last_step) or after.last):
            return
        config, acc = self.config, self.train_step.accelerator
        samples_per_step = config.train_batch_size * config.gradient_accumulation_steps * acc.num_processes
        learning_rate = self.train_step.scheduler.get_last_lr()[0]
        logs = self.monitor.log_train(after.step, learning_rate, result.grad_norm, samples_per_step)
        psnr = self.monitor.last_psnr  # shown from the first validation on
        progress_bar.set_postfix(loss=f"{logs['train/loss']:.4f}", **({} if psnr is None else {"psnr": f"{psnr:.2f}"}))

    def plan(self, after: AfterStep, budget: TimeBudget, progress_bar: tqdm) -> AfterStep:
        """Let the time budget plan at this step; what follows the step under its plan."""
        first_plan = not self.progress.planned_steps
        after = budget.planned(after)
        progress_bar.total = self.progress.planned_steps
        if first_plan and self.train_step.accelerator.is_main_process:
            warn_if_short(self.config, self.progress.planned_steps, budget.budget)
        progress_bar.refresh()
        return after


def train_windows(
    run: TrainingRun,
    batches: Prefetcher,
    budget: TimeBudget,
    progress_bar: tqdm,
    profiler: torch.profiler.profile | None,
) -> tuple[str, VideoDataError | None]:
    """The loop: each pass trains one accumulation window, then does what follows the step;
    returns why it stopped (and the data error when the data went away)."""
    train_step, progress = run.train_step, run.progress
    stop_reason = "finished" if budget.reached(progress.step) else None
    train_step.model.train()
    while stop_reason is None:
        result = train_step(batches, progress.next_window)  # one accumulation window: its step taken, or skipped
        progress.count(result)
        run.monitor.add_window(result)
        if result.data_failed:  # on some rank: every rank dropped the unfinished window
            # a stop that came while a rank waited for its batch is a stop; else the data went away
            return ("signal", None) if result.stop_requested else ("data", result.data_error)
        if not result.applied:
            stop_reason = run.skipped(result)
            continue
        if profiler is not None:
            profiler.step()
        progress_bar.update(1)
        after = budget.after_step(progress.step)
        run.log(result, after, budget, progress_bar)
        early_stop = False
        if after.validates and run.val_set is not None:
            try:
                with budget.aside("validation"):
                    early_stop = run.validate(after.draws)
            except ValidationDataError as err:  # raised on every rank together; the step is saved by finish
                return "data", err
        if after.measures_checkpoint:
            with budget.aside("checkpoint"):
                run.checkpoint()
        if after.plans:  # the time budget fixes (or corrects) the run's step count
            after = run.plan(after, budget, progress_bar)
        if after.checkpoints:
            with budget.aside("checkpoint"):
                run.checkpoint()
        if after.last:
            logger.info("training ends at step %d: %s", after.step, budget.ending(after.step, after.out_of_time))
            return "finished", None
        stop_reason = "early_stop" if early_stop else "signal" if result.stop_requested else None
    return stop_reason, None
