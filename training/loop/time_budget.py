"""A wall-clock budget (``max_train_time``): the run's length, planned as a step count and
re-planned as the run goes, so that the run ends within the budget on a machine whose speed
changes.

Step-based schedules (cosine or linear decay) and a progress bar need to know where the
run ends, so the budget is turned into a plan:

- The clock starts when the launch began (``TAEHV_STARTED_AT``, set by the launch script
  and ``training.launch``) or when this process started: loading the libraries, reading
  the data and building the model count against the budget.
- The seconds per step are measured from the third step of this process on, for 2% of
  the budget (at least ``MEASURED_STEPS`` steps); the time spent validating and
  checkpointing is left out and measured on its own (``aside``). Until then the config's
  intervals apply, and a budget that runs out ends the run (a start-up longer than the
  budget).
- At the step the measurement is complete, the run validates and checkpoints (whatever the
  intervals say; only what this run has not measured yet) to measure what each costs,
  then plans: ``planned_steps`` is the steps that fit in the time left, with the
  validations and checkpoints still to come and the ending (a last validation, a
  checkpoint and the final export, reserved as ``ENDING_CHECKPOINTS`` checkpoints; the
  process's exit, ``EXIT_SHARE`` of what loading its libraries took) and
  ``MARGIN_SHARE`` of the budget kept aside; capped by ``max_train_steps`` when that is
  set (0: no step limit; a budget typed without it is the run's length,
  ``common.config.with_budget``). ``validations_per_budget`` spreads that many
  validations over the planned steps, with image strips and checkpoints at the config's
  ratios to ``validation_every`` (``Cadence``), fewer when they would take more than
  ``ASIDE_SHARE`` of the time left; the learning-rate schedule's horizon becomes the
  planned count.
- Every ``REPLAN_SHARE`` of the planned steps the run plans again from the seconds per
  step since the last plan: a machine that slows down or speeds up moves the end, and the
  schedule's horizon follows without a jump in the rate (``LearningRateSchedule.retarget``).
  The intervals stay as first planned. Every rank takes rank 0's plan.
- The plan, the seconds spent and what a validation and a checkpoint cost are saved in
  every checkpoint. A resumed run goes on with them and plans again once it has measured
  its own steps: it ends when the run's time reaches the budget, as an uninterrupted run
  does. That time is the seconds up to the checkpoint plus this process's own, its
  start-up included (the pause and the work after the checkpoint, trained again, are not
  counted), so it trains as many fewer steps as its start-up took. A resume that changes
  what the plan was made for (``PLAN_KEYS``) plans afresh.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from taehv_train.common.config import TrainConfig
from taehv_train.training.loop.optimisation import LearningRateSchedule, parse_duration
from taehv_train.training.loop.resilience import agree, broadcast_numbers

logger = logging.getLogger(__name__)
WARMUP_STEPS = 2  # this process's first steps, left out of the measurement (kernel selection, allocator growth)
MEASURED_STEPS = 3  # the fewest steps a plan is measured over
MEASURED_SHARE = 0.02  # of the budget, measured before the first plan
REPLAN_SHARE = 0.01  # of the planned steps between two plans
MARGIN_SHARE = 0.01  # of the budget, left unplanned: the process's exit, the clocks' noise
ENDING_CHECKPOINTS = 2  # what the ending saves, in checkpoints: its checkpoint and the final export (smaller)
ASIDE_SHARE = 0.25  # of the time left at the first plan, the most its spread validations and checkpoints take
PLAN_KEYS = ("max_train_time", "max_train_steps", "validations_per_budget")  # what a plan is made for
LAUNCH_STARTED = "TAEHV_STARTED_AT"  # the wall-clock time (time.time()) the launch began
# the process's exit (the interpreter unloading its libraries) as a share of what loading them took:
# 0.18-0.20 measured on a busy 2-core AMD EPYC (2026-11-29: 1.3-1.8 s to exit after 6.5-9.7 s of imports)
EXIT_SHARE = 0.2


@dataclass(frozen=True)
class ProcessClock:
    """When the run's clock started for this process (``time.perf_counter``'s scale), and
    the seconds its exit will take, which the plan reserves."""

    started: float
    exiting: float

    @classmethod
    def measure(cls, process_started: float | None) -> ProcessClock:
        """Now, after the libraries are loaded; ``process_started``: ``time.perf_counter()``
        when this process started, before it loaded them (None: a run inside a process
        that was started for something else, whose clock starts now)."""
        now = time.perf_counter()
        if process_started is None:
            return cls(launch_started(now), 0.0)
        return cls(launch_started(process_started), EXIT_SHARE * (now - process_started))


def launch_started(process_started: float) -> float:
    """When the run's clock starts, on ``time.perf_counter``'s scale: the launch's start
    (``TAEHV_STARTED_AT``, set by whatever launched this process) when it is earlier than
    ``process_started`` (this process's own start)."""
    text = os.environ.get(LAUNCH_STARTED)
    if not text:
        return process_started
    return min(process_started, time.perf_counter() - (time.time() - float(text)))


class RunProgress(Protocol):
    step: int
    train_seconds: float
    planned_steps: int
    validation_every: int
    validation_seconds: float
    checkpoint_seconds: float

    def spend(self, seconds: float) -> None: ...
    def cost(self, kind: str, seconds: float) -> None: ...
    def fix_plan(self, planned_steps: int, validation_every: int) -> None: ...


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


@dataclass(frozen=True)
class AfterStep:
    """What the loop does after applied step ``step``, in this order: validate (with a
    reconstruction strip when ``draws``), checkpoint to measure one (``measures_checkpoint``),
    let the budget plan (``plans``: ``TimeBudget.planned``), checkpoint (``checkpoints``),
    and end the run when ``last`` (``out_of_time``: the budget ran out before its plan)."""

    step: int
    last: bool
    out_of_time: bool
    validates: bool
    draws: bool
    measures_checkpoint: bool
    plans: bool
    checkpoints: bool


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
        exiting: float = 0.0,
    ):
        """``started``: ``time.perf_counter()`` when the run's clock started for this process
        (``launch_started``; its start-up counts against the budget); ``device``: where the
        ranks agree on what their clocks say; ``exiting``: the seconds the process's exit
        will take (``ProcessClock``), reserved with the ending."""
        self.config, self.progress, self.schedule, self.processes = config, progress, schedule, processes
        self.device, self.exiting = device, exiting
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

    def _spread(self, left: float, each: float) -> int:
        """How many validations the first plan spreads: ``validations_per_budget``, fewer
        when they would take more than ``ASIDE_SHARE`` of the time ``left`` (``each``: a
        validation and the checkpoints at the config's ratio to it), at least one."""
        wanted = self.config.validations_per_budget
        fits = math.floor(ASIDE_SHARE * left / each) if each else wanted
        return max(1, min(wanted, fits)) if wanted else 0

    @property
    def cadence(self) -> Cadence:
        return Cadence.of(self.config, self.progress.validation_every)

    def spent(self) -> float:
        """Seconds spent on the run so far, earlier processes of a resumed run included."""
        return self._spent_before + time.perf_counter() - self._started

    def account(self) -> None:
        """After a step: record the seconds spent so far in the run's progress (saved with
        it); the measurement starts once this process's first steps are done."""
        self.progress.spend(self.spent())
        if self._mark is None and self.progress.step - self._first_step >= WARMUP_STEPS:
            self._mark = (self.progress.step, self._on_steps())

    def _on_steps(self) -> float:
        return self.progress.train_seconds - self._aside

    @contextmanager
    def aside(self, kind: str) -> Iterator[Stopwatch]:
        """Time spent on something other than steps, a ``"validation"`` or a
        ``"checkpoint"``: left out of the seconds per step, and kept as what the next one
        will cost."""
        watch, begin = Stopwatch(), time.perf_counter()
        yield watch
        watch.seconds = time.perf_counter() - begin
        self._aside += watch.seconds
        self.progress.cost(kind, watch.seconds)
        self.account()

    def reached(self, step: int) -> bool:
        """Whether ``step`` is the last one by the step count (the plan's, else ``max_train_steps``)."""
        return self.last_step is not None and step >= self.last_step

    def check(self) -> tuple[bool, bool]:
        """After a step's ``account``: (the budget is spent before the first plan, this step
        plans), the same on every rank. Until the first plan each rank's clock says (any
        rank's: one small all-reduce a step with several processes); from then on the count
        of steps since the last plan does, which every rank keeps alike."""
        if self.budget is None:
            return False, False
        progress = self.progress
        since = None if self._mark is None else progress.step - self._mark[0]
        if progress.planned_steps:
            due = since is not None and since >= max(MEASURED_STEPS, math.ceil(REPLAN_SHARE * progress.planned_steps))
            return False, due and not self.reached(progress.step)
        measured = since is not None and since >= MEASURED_STEPS
        measured = measured and self._on_steps() - self._mark[1] >= MEASURED_SHARE * self.budget
        spent, measured = agree([progress.train_seconds >= self.budget, measured], self.device)
        return spent, measured

    def after_step(self, step: int) -> AfterStep:
        """After applied step ``step``: account its time and say what follows it. A step
        that plans first validates and checkpoints when the run has not measured what each
        costs; what the plan changes (the last step, the checkpoint interval) comes from
        ``planned``."""
        self.account()
        out_of_time, planning = self.check()  # until a time budget's plan: its clock
        last = out_of_time or self.reached(step)
        cadence = self.cadence
        measures = planning and self.unmeasured("checkpoint")
        return AfterStep(
            step,
            last,
            out_of_time,
            validates=cadence.validates(step) or last or (planning and self.unmeasured("validation")),
            draws=cadence.draws(step) or last,
            measures_checkpoint=measures,
            plans=planning and not last,
            checkpoints=not measures and (cadence.checkpoints_at(step) or last),
        )

    def planned(self, after: AfterStep) -> AfterStep:
        """Plan at ``after.step`` (its measuring validation and checkpoint done), then what
        follows the step under the new plan."""
        self.plan()
        last = self.reached(after.step)
        checkpoints = not after.measures_checkpoint and (self.cadence.checkpoints_at(after.step) or last)
        return replace(after, last=last, plans=False, checkpoints=checkpoints)

    def unmeasured(self, kind: str) -> bool:
        """Whether the run has not measured yet what a ``kind`` (``validation``,
        ``checkpoint``) costs: a step that plans does one first, to measure it."""
        return not getattr(self.progress, f"{kind}_seconds")

    def plan(self) -> int:
        """Fix (or correct) the step count, and at the first plan the validation interval,
        from the seconds per step since the last plan and what a validation and a
        checkpoint cost; the schedule's horizon follows. Returns the planned count."""
        progress, config = self.progress, self.config
        mark_step, mark_seconds = self._mark
        per_step = max((self._on_steps() - mark_seconds) / (progress.step - mark_step), 1e-6)
        validation, checkpoint = progress.validation_seconds, progress.checkpoint_seconds  # 0: none done
        ending = validation + ENDING_CHECKPOINTS * checkpoint + self.exiting + MARGIN_SHARE * self.budget
        left = max(self.budget - progress.train_seconds - ending, 0.0)
        each = validation + checkpoint * config.validation_every / config.checkpointing_steps
        spread = 0 if progress.planned_steps else self._spread(left, each)
        if spread:  # that many validations (and checkpoints at the config's ratio) to come, whatever the step count
            steps = (left - spread * each) / per_step
        else:  # at the intervals in force
            cadence = self.cadence
            steps = left / (per_step + validation / cadence.validation + checkpoint / cadence.checkpoints)
        planned = progress.step + math.floor(steps)
        if config.max_train_steps:
            planned = min(planned, config.max_train_steps)
        planned = max(planned, progress.step)
        every = max(1, math.ceil(planned / spread)) if spread else progress.validation_every
        if spread and spread < config.validations_per_budget:
            logger.warning(
                "validations_per_budget=%d: %d validation(s) of %.1f s each (with their checkpoints) fit in the %.0f%% "
                "of the %.0f s left that they may take; validating every %d steps",
                config.validations_per_budget,
                spread,
                each,
                100 * ASIDE_SHARE,
                left,
                every,
            )
        before = progress.planned_steps
        progress.fix_plan(*map(int, broadcast_numbers([planned, every], self.device)))
        self.schedule.retarget(progress.step * self.processes, progress.planned_steps * self.processes)
        self._mark = (progress.step, self._on_steps())
        self._log_plan(before, per_step, mark_step, validation, checkpoint, left)
        return progress.planned_steps

    def _log_plan(
        self, before: int, per_step: float, mark_step: int, validation: float, checkpoint: float, left: float
    ) -> None:
        progress, config = self.progress, self.config
        capped = (
            f" (max_train_steps={config.max_train_steps})" if progress.planned_steps == config.max_train_steps else ""
        )
        if not before:
            cadence = self.cadence
            logger.info(
                "time budget %.0f s: %.3f s a step over steps %d-%d, %.1f s a validation, %.1f s a checkpoint, "
                "%.0f s left for steps: the run ends at step %d%s; validation every %d steps, image strips every %s, "
                "checkpoints every %d",
                self.budget,
                per_step,
                mark_step + 1,
                progress.step,
                validation,
                checkpoint,
                left,
                progress.planned_steps,
                capped,
                cadence.validation,
                cadence.images or "(none but the last)",
                cadence.checkpoints,
            )
            return
        moved = abs(progress.planned_steps - before) > REPLAN_SHARE * before
        logger.log(
            logging.INFO if moved else logging.DEBUG,
            "time budget: %.3f s a step over steps %d-%d, %.0f s spent of %.0f s: the run now ends at step %d%s "
            "(was %d)",
            per_step,
            mark_step + 1,
            progress.step,
            progress.train_seconds,
            self.budget,
            progress.planned_steps,
            capped,
            before,
        )

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
