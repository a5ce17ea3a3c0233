"""A wall-clock budget (``max_train_time``) turned into a step count early in the run.

Step-based schedules (cosine or linear decay) need to know where the run ends, so the
budget is converted once: from the first validation step on (so that one validation's
cost is in the measurement), the seconds per step since the second step of this process
give ``planned_steps`` = the steps that fit in the time left, capped by
``max_train_steps``. That count, the learning-rate schedule's horizon and the seconds
spent so far are saved in every checkpoint, so a run resumed after the conversion
continues exactly as it would have; one resumed before it measures again. If the budget
runs out before the planned step (a slower machine, costly checkpoints), the run ends
there all the same. Either way the run ends as at ``max_train_steps``: a last
validation, a checkpoint and the final export.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Protocol

from training.loop.optimisation import LearningRateSchedule

logger = logging.getLogger(__name__)
WARMUP_STEPS = 2  # this process's first steps, left out of the measurement (kernel selection, allocator growth)


class RunProgress(Protocol):
    step: int
    train_seconds: float
    planned_steps: int


class TimeBudget:
    """Wall-clock accounting of a run and the step it ends at."""

    def __init__(
        self,
        budget_seconds: float | None,
        max_train_steps: int,
        measure_until: int,
        progress: RunProgress,
        schedule: LearningRateSchedule,
        processes: int,
        started: float,
    ):
        """``started``: ``time.perf_counter()`` when this process began working on the run
        (its start-up counts against the budget); ``measure_until``: the step whose end
        fixes the plan (the first validation step)."""
        self.budget, self.max_train_steps, self.measure_until = budget_seconds, max_train_steps, measure_until
        self.progress, self.schedule, self.processes = progress, schedule, processes
        self._started, self._spent_before = started, progress.train_seconds
        self._first_step = progress.step
        self._mark: tuple[int, float] | None = None  # (step, seconds spent) where the measurement starts

    @property
    def last_step(self) -> int:
        """The step the run ends at: the planned one once fixed, else ``max_train_steps``."""
        return self.progress.planned_steps or self.max_train_steps

    def spent(self) -> float:
        """Seconds spent on the run so far, earlier processes of a resumed run included."""
        return self._spent_before + time.perf_counter() - self._started

    def account(self) -> None:
        """Record the seconds spent so far in the run's progress (saved with it)."""
        self.progress.train_seconds = self.spent()

    def exhausted(self) -> bool:
        return self.budget is not None and self.progress.train_seconds >= self.budget

    def plan(self) -> int | None:
        """After a step's validation and checkpoint: once the measuring step is reached,
        fix the step count and the schedule's horizon; returns the count when fixed now."""
        progress = self.progress
        self.account()
        if self.budget is None or progress.planned_steps:
            return None
        if self._mark is None:
            if progress.step - self._first_step >= WARMUP_STEPS:
                self._mark = (progress.step, progress.train_seconds)
            return None
        if progress.step < self.measure_until:
            return None
        mark_step, mark_seconds = self._mark
        per_step = (progress.train_seconds - mark_seconds) / (progress.step - mark_step)
        fitting = progress.step + math.floor(max(self.budget - progress.train_seconds, 0) / per_step)
        progress.planned_steps = max(progress.step, min(fitting, self.max_train_steps))
        self.schedule.total = progress.planned_steps * self.processes
        logger.info(
            "time budget %.0f s: %.3f s per step over steps %d-%d (validation included), %.0f s left: "
            "the run ends at step %d%s",
            self.budget,
            per_step,
            mark_step + 1,
            progress.step,
            self.budget - progress.train_seconds,
            progress.planned_steps,
            " (max_train_steps)" if progress.planned_steps == self.max_train_steps else "",
        )
        return progress.planned_steps
