"""The time budget (``max_train_time``) and the learning-rate schedules it adjusts."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from diffusers.optimization import get_scheduler

from training.loop import time_budget
from training.loop.optimisation import LearningRateSchedule, parse_duration
from training.loop.time_budget import TimeBudget


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("8h", 28800),
        ("45m", 2700),
        ("1h30m", 5400),
        ("90s", 90),
        ("600", 600),
        ("1.5h", 5400),
        ("", None),
        ("0", None),
        ("-3m", None),
        ("8 hours", None),
    ],
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("kind", ["constant", "constant_with_warmup", "cosine", "linear"])
def test_the_schedules_are_diffusers_schedules(kind):
    """Bit-equal factors to ``diffusers.optimization.get_scheduler`` at every step, past the end too."""
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    reference = get_scheduler(kind, optimizer, num_warmup_steps=7, num_training_steps=50)
    schedule = LearningRateSchedule(kind, 7, 50)
    for step in range(60):
        assert reference.get_last_lr()[0] == schedule(step), step
        optimizer.step()
        reference.step()


def test_a_budget_fixes_the_step_count_once_from_the_measured_speed(monkeypatch):
    clock = [10.0]  # 10 s of start-up before the first step
    monkeypatch.setattr(time_budget.time, "perf_counter", lambda: clock[0])
    progress = SimpleNamespace(step=0, train_seconds=0.0, planned_steps=0)
    schedule = LearningRateSchedule("cosine", 0, 2 * 1000)
    budget = TimeBudget(100.0, 1000, 5, progress, schedule, processes=2, started=0.0)
    planned = []
    for step, seconds in enumerate([6, 6, 3, 3, 3, 3, 3], start=1):  # two slow first steps, then 3 s a step
        clock[0] += seconds
        progress.step = step
        budget.account()
        planned.append(budget.plan())
    # measured over steps 3-5 (9 s for 3 steps); at step 5 the run has spent 10 + 21 s: 69 s left = 23 steps
    assert planned == [None, None, None, None, 28, None, None]
    assert progress.planned_steps == budget.last_step == 28 and schedule.total == 2 * 28
    assert progress.train_seconds == 10 + 27 and not budget.exhausted()
    clock[0] += 63
    budget.account()
    assert budget.exhausted()

    # a resumed run keeps the plan and counts the seconds spent before
    clock[0] = 0.0
    resumed = TimeBudget(100.0, 1000, 5, progress, schedule, processes=2, started=0.0)
    clock[0] = 1.0
    assert resumed.plan() is None and resumed.last_step == 28 and math.isclose(resumed.spent(), 10 + 27 + 63 + 1)


def test_max_train_steps_caps_the_plan(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(time_budget.time, "perf_counter", lambda: clock[0])
    progress = SimpleNamespace(step=0, train_seconds=0.0, planned_steps=0)
    budget = TimeBudget(3600.0, 8, 3, progress, LearningRateSchedule("constant", 0, 8), 1, 0.0)
    for step in range(1, 4):
        clock[0] += 1
        progress.step = step
        budget.plan()
    assert progress.planned_steps == 8
