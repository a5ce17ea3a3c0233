"""What a run of a preset will likely reach in the steps it plans, from measured curves.

Step counts, unlike seconds, carry from one machine to another: the table holds, per
preset, the held-out PSNR measured after so many steps (``docs/benchmarks.md``) and the
steps to a useful model. A run whose step count (a time budget's plan, or
``max_train_steps``) is far below that says so in one line at its start or its plan,
with what to change. The same table is in docs/training.md ("What a run reaches");
presets with no measurement are listed there as such and never warned about.
"""

from __future__ import annotations

import bisect
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from taehv_train.common.config import TrainConfig
from taehv_train.common.presets import PREFIX

logger = logging.getLogger(__name__)
FAR_BELOW = 0.5  # a run planning fewer than this share of the steps its preset needs is warned


@dataclass(frozen=True)
class Expectation:
    """A preset's measured quality: ``curve`` is (steps, held-out PSNR dB) in step order;
    ``needs`` the steps to a useful model."""

    needs: int
    curve: tuple[tuple[int, float], ...]

    def psnr_at(self, steps: int) -> tuple[str, float]:
        """("~" or "under ", dB) the preset reaches after ``steps``: interpolated in log-steps
        between measurements, the last one beyond them; "under" the first one before it."""
        counts = [count for count, _ in self.curve]
        if steps < counts[0]:
            return "under ", self.curve[0][1]
        i = bisect.bisect_right(counts, steps)
        if i == len(counts):
            return "~", self.curve[-1][1]
        (s0, p0), (s1, p1) = self.curve[i - 1], self.curve[i]
        share = (math.log(steps) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return "~", p0 + share * (p1 - p0)


EXPECTATIONS: dict[str, Expectation] = {
    # 3 seeds' validation, 9 frames at 64x64 of 2 held-out clips (docs/benchmarks.md, "Time to quality", 2026-11-26)
    "scratch": Expectation(
        1000,
        ((100, 15.0), (200, 17.0), (300, 18.1), (500, 19.0), (1000, 19.9), (1300, 20.4)),
    ),
    # validation on the 6 held-out demo clips at 96x144 (docs/benchmarks.md, "Demo training run", 2026-11-24)
    "demo": Expectation(
        2600,
        ((200, 17.6), (400, 19.8), (600, 20.7), (1000, 21.9), (1600, 22.8), (2600, 23.3)),
    ),
}


def preset_name(config: TrainConfig) -> str:
    """The preset a config file is (``taehv_config_<name>.py``), or the file's own name."""
    stem = Path(config.config_file).stem if config.config_file else ""
    return stem.removeprefix(PREFIX)


def duration_text(seconds: float) -> str:
    """``seconds`` as a ``max_train_time`` a user types, rounded up: 2h, 1h30m, 45m."""
    minutes = max(1, math.ceil(seconds / 60))
    if minutes < 60:
        return f"{minutes}m"
    hours, rest = divmod(minutes, 60)
    return f"{hours}h{rest}m" if rest else f"{hours}h"


def short_run_warning(config: TrainConfig, steps: int, budget: float | None = None) -> str | None:
    """The line a run of ``steps`` steps gets when that is far below what its preset
    needs (None otherwise, or when the preset has no measurement); ``budget``: the time
    budget's seconds that planned ``steps``, to say how long the needed steps take here."""
    name = preset_name(config)
    expectation = EXPECTATIONS.get(name)
    if expectation is None or steps >= FAR_BELOW * expectation.needs:
        return None
    how, psnr = expectation.psnr_at(steps)
    useful = expectation.psnr_at(expectation.needs)[1]
    if budget is not None and steps:
        change = (
            f"at this machine's speed that is ~{duration_text(budget * expectation.needs / steps)}: "
            f"raise --max_train_time to it or train on a GPU"
        )
    else:
        change = f"raise --max_train_steps to ~{expectation.needs}"
    return (
        f"this run trains {steps} steps: the {name} preset reaches {how}{psnr:.0f} dB held-out PSNR there, and a "
        f"useful model (~{useful:.0f} dB) needs ~{expectation.needs} steps (docs/training.md, 'What a run reaches'); "
        f"{change}"
    )


def warn_if_short(config: TrainConfig, steps: int, budget: float | None = None) -> None:
    """Log ``short_run_warning``'s line, if any."""
    line = short_run_warning(config, steps, budget)
    if line is not None:
        logger.warning("%s", line)
