"""A wall-clock budget (``max_train_time``): the run's length, fixed as a step count early on.

Step-based schedules (cosine or linear decay) and a progress bar need to know where the
run ends, so the budget is turned into a plan once, early, and saved:

- The seconds per step are measured from the third step of this process on, for 2% of
  the budget (at least ``MEASURED_STEPS`` steps); the time spent validating and
  checkpointing is left out. Until then the config's intervals apply, and a budget that
  runs out ends the run (a start-up longer than the budget).
- At the step the measurement is complete, the run validates (whatever the intervals say)
  to measure what a validation costs, then fixes ``planned_steps``: the steps that fit in
  the time left with the validations still to come, capped by ``max_train_steps`` when
  that is set (0: no step limit; a budget typed without it is the run's length,
  ``common.config.with_budget``). ``validations_per_budget`` spreads that many
  validations over the planned steps, with image strips and checkpoints at the config's
  ratios to ``validation_every`` (``Cadence``); the learning-rate schedule's horizon
  becomes the planned count.
- The plan is saved in every checkpoint, and from then on it alone ends the run: a run
  stopped and resumed ends where an uninterrupted one would, and a resumed process's
  start-up (or a machine slower than the one measured) runs over the budget instead. A
  run resumed before the plan measures again. Checkpoints and the final export are not in
  the estimate.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from taehv_train.common.config import TrainConfig
from taehv_train.training.loop.optimisation import LearningRateSchedule, parse_duration
from taehv_train.training.loop.resilience import agree, broadcast_numbers

logger = logging.getLogger(__name__)
WARMUP_STEPS = 2  # this process's first steps, left out of the measurement (kernel selection, allocator growth)
MEASURED_STEPS = 3  # the fewest steps the plan is measured over
MEASURED_SHARE = 0.02  # of the budget, measured before the plan
PLAN_KEYS = ("max_train_time", "max_train_steps", "validations_per_budget")  # what a plan is made for


class RunProgress(Protocol):
    step: int
    train_seconds: float
    planned_steps: int
    validation_every: int


@dataclass(frozen=True)
class Cadence:
    """Steps between validations, between reconstruction strips (0: only the last; they are
    drawn at validations) and between checkpoints."""

    validation: int
    images: int
    checkpoints: int

    @classmethod
    def of(cls, config: TrainConfig, spread: int = 0) -> Cadence:
        """The config's intervals, or, with ``spread`` (the validation interval a time
        budget chose), each scaled by ``spread / validation_every``: strips every so many
        validations, checkpoints at the same share of the run."""
        if not spread:
            return cls(config.validation_every, config.image_log_every, config.checkpointing_steps)
        images = spread * max(1, round(config.image_log_every / config.validation_every))
        checkpoints = max(1, round(config.checkpointing_steps * spread / config.validation_every))
        return cls(spread, images if config.image_log_every else 0, checkpoints)

    def validates(self, step: int) -> bool:
        return step % self.validation == 0

    def draws(self, step: int) -> bool:
        return bool(self.images) and step % self.images == 0

    def checkpoints_at(self, step: int) -> bool:
        return step % self.checkpoints == 0


@dataclass
class Stopwatch:
    """Seconds spent inside a ``with TimeBudget.aside()`` block."""

    seconds: float = 0.0


class TimeBudget:
    """Wall-clock accounting of a run, its plan and the step it ends at."""

    def __init__(
        self,
        config: TrainConfig,
        progress: RunProgress,
        schedule: LearningRateSchedule,
        processes: int,
        started: float,
        device: torch.device,
    ):
        """``started``: ``time.perf_counter()`` when this process began working on the run
        (its start-up counts against the budget); ``device``: where the ranks agree on what
        their clocks say."""
        self.config, self.progress, self.schedule, self.processes = config, progress, schedule, processes
        self.device = device
        self.budget = parse_duration(config.max_train_time) if config.max_train_time else None
        self._started, self._spent_before = started, progress.train_seconds
        self._first_step = progress.step
        self._aside = 0.0  # seconds of this process spent validating and checkpointing
        self._mark: tuple[int, float] | None = None  # (step, seconds on steps) where the measurement starts

    @property
    def last_step(self) -> int | None:
        """The step the run ends at: the planned one once fixed, else ``max_train_steps``;
        None while a budget with no step limit has not fixed it."""
        return self.progress.planned_steps or self.config.max_train_steps or None

    @property
    def cadence(self) -> Cadence:
        return Cadence.of(self.config, self.progress.validation_every)

    def spent(self) -> float:
        """Seconds spent on the run so far, earlier processes of a resumed run included."""
        return self._spent_before + time.perf_counter() - self._started

    def account(self) -> None:
        """After a step: record the seconds spent so far in the run's progress (saved with
        it); the measurement starts once this process's first steps are done."""
        self.progress.train_seconds = self.spent()
        if self._mark is None and self.progress.step - self._first_step >= WARMUP_STEPS:
            self._mark = (self.progress.step, self._on_steps())

    def _on_steps(self) -> float:
        return self.progress.train_seconds - self._aside

    @contextmanager
    def aside(self) -> Iterator[Stopwatch]:
        """Time spent on something other than steps (validating, checkpointing): left out of
        the seconds per step, and measured."""
        watch, begin = Stopwatch(), time.perf_counter()
        yield watch
        watch.seconds = time.perf_counter() - begin
        self._aside += watch.seconds
        self.account()

    def reached(self, step: int) -> bool:
        """Whether ``step`` is the last one by the step count (the plan's, else ``max_train_steps``)."""
        return self.last_step is not None and step >= self.last_step

    def check(self) -> tuple[bool, bool]:
        """After a step's ``account``, until the plan: (the budget is spent, the measurement
        is complete so the plan is fixed at this step), the same on every rank (each has its
        own clock: any rank's says; with several processes, one small all-reduce a step)."""
        if self.budget is None or self.progress.planned_steps:
            return False, False
        spent = self.progress.train_seconds >= self.budget
        measured = self._mark is not None and self.progress.step - self._mark[0] >= MEASURED_STEPS
        measured = measured and self._on_steps() - self._mark[1] >= MEASURED_SHARE * self.budget
        spent, measured = agree([spent, measured], self.device)
        return spent, measured

    def plan(self, validation_seconds: float) -> int:
        """Fix the step count, the validation interval and the schedule's horizon from the
        measured seconds per step and ``validation_seconds`` (what one validation costs; 0
        without validation); returns the planned count."""
        progress, config = self.progress, self.config
        mark_step, mark_seconds = self._mark
        per_step = (self._on_steps() - mark_seconds) / (progress.step - mark_step)
        left = max(self.budget - progress.train_seconds, 0.0)
        spread = config.validations_per_budget
        if spread:  # that many validations to come, whatever the step count
            steps = max(left - spread * validation_seconds, 0.0) / per_step
        else:  # one every validation_every steps
            steps = left / (per_step + validation_seconds / config.validation_every)
        planned = progress.step + math.floor(steps)
        if config.max_train_steps:
            planned = min(planned, config.max_train_steps)
        planned = max(planned, progress.step)
        every = max(1, math.ceil(planned / spread)) if spread else 0
        progress.planned_steps, progress.validation_every = map(int, broadcast_numbers([planned, every], self.device))
        self.schedule.total = progress.planned_steps * self.processes
        cadence = self.cadence
        logger.info(
            "time budget %.0f s: %.3f s a step over steps %d-%d, %.1f s a validation, %.0f s left: the run ends at "
            "step %d%s; validation every %d steps, image strips every %s, checkpoints every %d",
            self.budget,
            per_step,
            mark_step + 1,
            progress.step,
            validation_seconds,
            left,
            progress.planned_steps,
            f" (max_train_steps={config.max_train_steps})" if progress.planned_steps == config.max_train_steps else "",
            cadence.validation,
            cadence.images or "(none but the last)",
            cadence.checkpoints,
        )
        return progress.planned_steps

    def ending(self, step: int, spent: bool) -> str:
        """Why the run ends at ``step`` (for the log); ``spent``: the budget ran out before the plan."""
        config = self.config
        if spent:
            return f"the time budget max_train_time={config.max_train_time} is spent"
        if config.max_train_steps and step >= config.max_train_steps:
            before = f", before the time budget max_train_time={config.max_train_time}" if self.budget else ""
            return f"max_train_steps={config.max_train_steps} is reached{before}"
        return (
            f"the step count the time budget max_train_time={config.max_train_time} planned is reached "
            f"({self.progress.train_seconds:.0f} s of {self.budget:.0f} s spent)"
        )


def keeps_plan(saved: dict, config: TrainConfig) -> bool:
    """Whether a resumed run keeps the plan its checkpoint holds: the keys the plan was made
    for (``PLAN_KEYS``, as the run saved its config) are unchanged."""
    return all(saved.get(key, getattr(config, key)) == getattr(config, key) for key in PLAN_KEYS)
