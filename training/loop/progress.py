"""Where a run is: the one record a checkpoint saves so that a resumed run continues identically.

Its fields are written only through its methods: the prefetcher moves its data position
(``take``), the loop counts windows (``count``), the time budget records seconds and its
plan (``spend``, ``cost``, ``fix_plan``), and a resume that changes the run's length drops
the plan (``forget_plan``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from taehv_train.training.loop.step import StepResult


@dataclass
class Progress:
    """Where the run is: saved in every checkpoint so a resumed run continues identically."""

    step: int = 0  # optimizer steps applied
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch already consumed (per process)
    skipped_steps: int = 0  # steps skipped on all ranks (non-finite loss/gradient, out of memory)
    consecutive_skips: int = 0
    train_seconds: float = 0.0  # wall-clock seconds spent on the run, all its processes
    planned_steps: int = 0  # the step count max_train_time fixed (training.loop.time_budget); 0: max_train_steps
    validation_every: int = 0  # the validation interval max_train_time spread; 0: the config's intervals
    validation_seconds: float = 0.0  # what the last validation took (0: none yet), for the time budget's plan
    checkpoint_seconds: float = 0.0  # what the last checkpoint took (0: none yet)

    @property
    def next_window(self) -> int:
        """The number of the accumulation window to train next, counted from 1 (skipped ones included)."""
        return self.step + self.skipped_steps + 1

    def take(self, epoch: int, index: int) -> None:
        """The step took batch ``index`` (counted from 1) of ``epoch``: the data position
        follows what was trained, not what was fetched ahead."""
        self.epoch, self.batch_in_epoch = epoch, index

    def count(self, result: StepResult) -> None:
        """Count an accumulation window: a step taken, or a window skipped. A window whose
        data failed is neither: its micro-batches are given back (a window never spans two
        epochs, Accelerate ends one at an epoch's last batch), so a resumed run trains it whole."""
        if result.data_failed:
            self.batch_in_epoch -= result.micro_batches
        elif result.applied:
            self.step += 1
            self.consecutive_skips = 0
        else:
            self.skipped_steps += 1
            self.consecutive_skips += 1

    def spend(self, seconds: float) -> None:
        """The run has spent ``seconds`` so far, earlier processes included."""
        self.train_seconds = seconds

    def cost(self, kind: str, seconds: float) -> None:
        """The last ``kind`` (``validation``, ``checkpoint``) took ``seconds``."""
        setattr(self, f"{kind}_seconds", seconds)

    def fix_plan(self, planned_steps: int, validation_every: int) -> None:
        """The time budget's plan: the step the run ends at and the validation interval."""
        self.planned_steps, self.validation_every = planned_steps, validation_every

    def forget_plan(self) -> None:
        """A resume that changes the run's length: a time budget plans again."""
        self.fix_plan(0, 0)
