"""The time budget (``max_train_time``): the run's length, its plan, the intervals it
spreads, and the learning-rate schedules it adjusts."""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from diffusers.optimization import get_scheduler

from taehv_train.common.config import TrainConfig, load_config
from taehv_train.training.loop import optimisation, time_budget
from taehv_train.training.loop.optimisation import LearningRateSchedule, parse_duration
from taehv_train.training.loop.progress import Progress
from taehv_train.training.loop.time_budget import AfterStep, Cadence, TimeBudget, keeps_plan
from taehv_train.training.state.run_config import Start, config_for_resume, describe_start
from taehv_train.training.state.run_folders import checkpoint_step, list_checkpoints
from train_runs import (
    TEST_CONFIG,
    train_here,
)


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


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_a_horizon_not_known_yet_decays_nothing(kind):
    """A time budget with no step limit, before its plan: the warm-up, then the full rate."""
    schedule = LearningRateSchedule(kind, 4, 0)
    assert [schedule(step) for step in (0, 2, 4, 1000)] == [0.0, 0.5, 1.0, 1.0]


CPU = torch.device("cpu")


class Clock:
    """``time.perf_counter`` as the time budget reads it, moved by the test."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(time_budget, "time", SimpleNamespace(perf_counter=clock))
    return clock


def fresh_progress() -> Progress:
    return Progress()


def budget_config(**changes) -> TrainConfig:
    defaults = dict(max_train_time="100s", max_train_steps=0, validation_every=1000, checkpointing_steps=1000)
    return TrainConfig(**{**defaults, **changes})


def steps(budget: TimeBudget, clock: Clock, seconds: list[float], aside: dict[int, float] = ()) -> list[tuple]:
    """Steps of ``seconds`` each (and ``aside[step]`` seconds of checkpoint after them);
    what ``check`` says after each."""
    said = []
    for duration in seconds:
        clock.now += duration
        budget.progress.step += 1
        budget.account()
        if budget.progress.step in aside:
            with budget.aside("checkpoint") as watch:
                clock.now += aside[budget.progress.step]
            assert watch.seconds == aside[budget.progress.step]
        said.append(budget.check())
    return said


def validate(budget: TimeBudget, clock: Clock, seconds: float) -> None:
    with budget.aside("validation"):
        clock.now += seconds


def test_a_budget_plans_its_steps_and_spreads_its_validations_once_measured(clock):
    clock.now = 10.0  # 10 s of start-up before the first step
    progress = fresh_progress()
    schedule = LearningRateSchedule("cosine", 0, 0)
    budget = TimeBudget(budget_config(validations_per_budget=4), progress, schedule, 2, 0.0, CPU)
    assert budget.last_step is None and not budget.reached(10**6)  # no step limit: the plan will say
    # two slow first steps, then 3 s a step; a 1 s checkpoint after step 3 is not a step's time
    said = steps(budget, clock, [6, 6, 3, 3, 3], aside={3: 1})
    assert said == [(False, False)] * 4 + [(False, True)]  # 3 steps measured, 9 s >= 2% of the budget
    assert budget.unmeasured("validation") and not budget.unmeasured("checkpoint")
    validate(budget, clock, 1)  # the planning step measures what a validation costs
    # 33 s spent; the ending (a validation, two checkpoints' worth, 1% of the budget) 4 s; 63 s left,
    # 4 validations and checkpoints of 1 s each to come: 55 s for steps of 3 s, 18 more steps
    assert budget.plan() == 23 == progress.planned_steps == budget.last_step
    assert progress.validation_every == 6 and budget.cadence == Cadence(6, 6, 6)
    assert schedule.total == 2 * 23
    assert progress.train_seconds == 33
    assert not budget.reached(22) and budget.reached(23)
    assert budget.ending(23, spent=False) == (
        "the step count the time budget max_train_time=100s planned is reached (33 s of 100 s spent)"
    )

    # a resumed run counts the seconds spent before and plans again once it has measured its own steps
    clock.now = 0.0
    resumed = TimeBudget(budget_config(validations_per_budget=4), progress, schedule, 2, 0.0, CPU)
    clock.now = 1.0
    assert resumed.check() == (False, False) and resumed.last_step == 23 and math.isclose(resumed.spent(), 34)
    assert steps(resumed, clock, [3] * 5) == [(False, False)] * 4 + [(False, True)]


def test_after_a_step_the_budget_says_what_follows_and_measures_before_it_plans(clock):
    progress = fresh_progress()
    budget = TimeBudget(budget_config(), progress, LearningRateSchedule("cosine", 0, 0), 1, 0.0, CPU)
    nothing = dict(last=False, out_of_time=False, validates=False, measures_checkpoint=False, plans=False)
    for duration in (6, 6, 3, 3):  # the measurement is not complete yet: the config's intervals (1000)
        clock.now += duration
        progress.step += 1
        after = budget.after_step(progress.step)
        assert after == AfterStep(progress.step, draws=after.draws, checkpoints=False, **nothing)
    clock.now += 3
    progress.step += 1
    after = budget.after_step(5)  # measured: it plans, first validating and checkpointing to measure them
    assert (after.validates, after.measures_checkpoint, after.plans, after.checkpoints) == (True, True, True, False)
    validate(budget, clock, 1)
    with budget.aside("checkpoint"):
        clock.now += 1
    after = budget.planned(after)
    assert progress.planned_steps == budget.last_step > 5
    assert not (after.plans or after.checkpoints or after.last)  # its checkpoint is taken, the run goes on

    fixed = TimeBudget(TrainConfig(max_train_steps=3), fresh_progress(), budget.schedule, 1, 0.0, CPU)
    fixed.progress.step = 3
    last = fixed.after_step(3)  # the last step validates with its strip and checkpoints
    assert (last.last, last.validates, last.draws, last.checkpoints, last.plans) == (True, True, True, True, False)


def test_a_machine_that_slows_down_moves_the_end_and_the_schedule_follows_without_a_jump(clock):
    progress = fresh_progress()
    schedule = LearningRateSchedule("cosine", 0, 0)
    budget = TimeBudget(budget_config(validations_per_budget=4), progress, schedule, 2, 0.0, CPU)
    steps(budget, clock, [6, 6, 3, 3, 3], aside={3: 1})
    validate(budget, clock, 1)
    assert budget.plan() == 26  # 23 s spent: as above, with 10 s more for steps
    every = max(time_budget.MEASURED_STEPS, math.ceil(time_budget.REPLAN_SHARE * 26))
    # the machine runs at half speed: the next plan, after `every` steps, moves the end closer
    said = steps(budget, clock, [6] * every)
    assert said == [(False, False)] * (every - 1) + [(False, True)]
    rate = schedule(2 * progress.step)
    # 41 s spent, 55 s left for steps of 6 s and a sixth of a validation and a checkpoint each: 8 more
    assert budget.plan() == 16 and schedule.total == 2 * 16
    assert schedule(2 * progress.step) == pytest.approx(rate, abs=1e-12)  # the rate goes on from where it was
    assert budget.cadence == Cadence(7, 7, 7)  # the intervals stay as first planned
    # then faster again: the end moves back out
    steps(budget, clock, [1.5] * every)
    assert budget.plan() > 16


def test_the_plan_spreads_fewer_validations_when_they_would_take_much_of_the_time_left(clock, caplog):
    progress = fresh_progress()
    budget = TimeBudget(
        budget_config(validations_per_budget=10), progress, LearningRateSchedule("constant", 0, 0), 1, 0.0, CPU
    )
    steps(budget, clock, [3] * 5, aside={3: 1})
    validate(budget, clock, 4)
    # 20 s spent, 73 s left after the ending: 5 s a validation and its checkpoint, at most a quarter of it
    budget.plan()
    assert progress.validation_every == math.ceil(progress.planned_steps / 3)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [
        "validations_per_budget=10: 3 validation(s) of 5.0 s each (with their checkpoints) fit in the 25% of the "
        f"73 s left that they may take; validating every {progress.validation_every} steps"
    ]


def test_without_spreading_the_plan_counts_the_configs_validations(clock):
    progress = fresh_progress()
    config = budget_config(validations_per_budget=0, validation_every=2)
    budget = TimeBudget(config, progress, LearningRateSchedule("constant", 0, 0), 1, 0.0, CPU)
    assert steps(budget, clock, [1, 1, 3, 3, 3])[-1] == (False, True)
    validate(budget, clock, 4)
    with budget.aside("checkpoint"):
        clock.now += 2
    # 17 s spent, 9 s for the ending: 74 s for steps of 3 s, half a validation and a thousandth of a checkpoint
    assert budget.plan() == 19 and progress.validation_every == 0
    assert budget.cadence == Cadence.of(config) == Cadence(2, 1000, 1000)


def test_a_step_limit_set_with_the_budget_caps_its_plan(clock):
    progress = fresh_progress()
    budget = TimeBudget(budget_config(max_train_steps=8), progress, LearningRateSchedule("constant", 0, 8), 1, 0.0, CPU)
    assert budget.last_step == 8
    assert steps(budget, clock, [1] * 5)[-1] == (False, True)
    assert budget.plan() == 8
    assert budget.ending(8, spent=False) == "max_train_steps=8 is reached, before the time budget max_train_time=100s"


def test_a_budget_spent_before_its_plan_ends_the_run(clock):
    progress = fresh_progress()
    budget = TimeBudget(budget_config(), progress, LearningRateSchedule("constant", 0, 0), 1, 0.0, CPU)
    assert steps(budget, clock, [150]) == [(True, False)]
    assert budget.ending(1, spent=True) == "the time budget max_train_time=100s is spent"
    no_budget = TimeBudget(TrainConfig(max_train_steps=3), fresh_progress(), budget.schedule, 1, 0.0, CPU)
    assert steps(no_budget, clock, [10**6] * 3) == [(False, False)] * 3 and no_budget.reached(3)
    assert no_budget.ending(3, spent=False) == "max_train_steps=3 is reached"


def test_the_clock_starts_when_the_launch_began(monkeypatch):
    now = time.time()
    monkeypatch.setenv(time_budget.LAUNCH_STARTED, repr(now - 5.0))
    assert time.perf_counter() - time_budget.launch_started(time.perf_counter()) == pytest.approx(5.0, abs=0.5)
    later = time.perf_counter() - 1.0  # a launch that began after this process: the process's start
    monkeypatch.setenv(time_budget.LAUNCH_STARTED, repr(now + 60.0))
    assert time_budget.launch_started(later) == later
    monkeypatch.delenv(time_budget.LAUNCH_STARTED)
    assert time_budget.launch_started(later) == later
    # a process that took 10 s loading its libraries reserves a fifth of that for its exit
    clock = time_budget.ProcessClock.measure(time.perf_counter() - 10.0)
    assert clock.exiting == pytest.approx(2.0, abs=0.1)
    assert time_budget.ProcessClock.measure(None).exiting == 0.0  # a run inside a test's process


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_a_horizon_that_moves_keeps_the_rate_and_decays_to_zero_at_the_new_end(kind):
    schedule = LearningRateSchedule(kind, 4, 100)
    for step, total in ((30, 60), (45, 200), (120, 130)):
        before = schedule(step)
        schedule.retarget(step, total)
        assert schedule(step) == pytest.approx(before, abs=1e-12)
        assert schedule(total) == pytest.approx(0.0, abs=1e-12)
        rates = [schedule(s) for s in range(step, total + 1)]
        assert rates == sorted(rates, reverse=True)  # it keeps decaying
    during_warmup = LearningRateSchedule(kind, 4, 0)
    during_warmup.retarget(2, 50)  # a horizon set during the warm-up: the decay starts after it
    assert during_warmup(4) == 1.0 and during_warmup(50) == pytest.approx(0.0, abs=1e-12)


def test_spread_intervals_keep_the_configs_ratios():
    scratch = TrainConfig(validation_every=100, image_log_every=100, checkpointing_steps=250)
    assert Cadence.of(scratch) == Cadence(100, 100, 250)
    assert Cadence.of(scratch, 7) == Cadence(7, 7, 18)
    assert Cadence.of(scratch.replace(image_log_every=300), 7).images == 21
    assert Cadence.of(scratch.replace(image_log_every=0), 7).images == 0
    cadence = Cadence(7, 14, 18)
    assert [s for s in range(1, 40) if cadence.validates(s)] == [7, 14, 21, 28, 35]
    assert [s for s in range(1, 40) if cadence.draws(s)] == [14, 28]
    assert [s for s in range(1, 40) if cadence.checkpoints_at(s)] == [18, 36]
    assert not any(Cadence(7, 0, 18).draws(s) for s in range(1, 40))


def test_a_budget_typed_without_a_step_count_is_the_runs_length():
    assert load_config(TEST_CONFIG).max_train_steps == 4  # the preset's
    assert load_config(TEST_CONFIG, ["--max_train_time=8m"]).max_train_steps == 0
    assert load_config(TEST_CONFIG, ["--max_train_time=8m", "--max_train_steps=300"]).max_train_steps == 300
    assert load_config(TEST_CONFIG, ["--max_train_time="]).max_train_steps == 4
    assert "max_train_steps=0 (no step limit) needs a time budget" in " ".join(
        optimisation.config_errors(TrainConfig(max_train_steps=0))
    )
    assert not optimisation.config_errors(TrainConfig(max_train_steps=0, max_train_time="8m"))
    # a resume line: the same rule over the run's own config
    preset = load_config(TEST_CONFIG)
    saved = {**preset.to_dict(), "max_train_steps": 500}
    config, changes = config_for_resume(preset, ["--max_train_time=8m"], saved)
    assert config.max_train_steps == 0 and "max_train_steps 500 -> 0" in changes
    config, changes = config_for_resume(preset, [], {**saved, "max_train_steps": 0, "max_train_time": "8m"})
    assert config.max_train_steps == 0 and changes == ()
    line = describe_start(Start(config, Path("run"), Path("run/checkpoints/checkpoint-3"), step=3, horizon=0))
    assert "checkpoint-3 at step 3 (its time budget has not planned its step count yet) (run run)" in line


def test_a_resume_keeps_the_plan_unless_it_changes_what_the_plan_was_made_for():
    config = budget_config(validations_per_budget=4)
    saved = config.to_dict()
    assert keeps_plan(saved, config)
    assert keeps_plan({k: v for k, v in saved.items() if k != "validations_per_budget"}, config)  # an older run
    for change in ({"max_train_time": "200s"}, {"max_train_steps": 50}, {"validations_per_budget": 0}):
        assert not keeps_plan(saved, config.replace(**change))


class Ticks:
    """A clock that moves one second each time it is read: a run under it takes the same
    (made-up) time on every machine, so its plan is the same every time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def train_on_ticks(monkeypatch, out: Path, clips: dict, *overrides: str) -> Path:
    """A run inside this process (``train_here``) whose time budget reads ``Ticks``."""
    from taehv_train.training import taehv_train

    ticks = SimpleNamespace(perf_counter=Ticks())
    with monkeypatch.context() as patch:
        patch.setattr(time_budget, "time", ticks)
        patch.setattr(taehv_train, "time", ticks)
        return train_here(out, clips, *overrides)


def trainer_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def spent_at_the_end(run: Path) -> int:
    """The run's seconds when its last step's validation and checkpoint are done, as its log says."""
    return int(re.findall(r"planned is reached \((\d+) s of \d+ s spent\)", (run / "train.log").read_text())[-1])


BUDGET = ["--max_train_time=60s", "--validations_per_budget=3", "--checkpoints_total_limit=100", "--run_name=run"]
BUDGET += ["--height=16", "--width=16"]  # on Ticks a step takes the same time at any size: the cheapest


@pytest.mark.slow  # two training runs
def test_a_budget_alone_is_the_runs_length_and_a_resumed_run_ends_when_the_budget_is_spent(
    monkeypatch, capsys, tmp_path, demo_clips
):
    """The test preset stops at step 4; typed alone, the budget outlasts it: the run measures
    its steps until step 5, validates and checkpoints there, plans its end and spreads its
    validations over it, and plans again as it goes; the progress bar counts to the plan.
    Stopped after the plan (its last checkpoints and ending taken away, as a kill leaves it)
    and resumed, it ends when the run's time reaches the budget, as the uninterrupted run did."""
    full = train_on_ticks(monkeypatch, tmp_path / "full", demo_clips, *BUDGET)
    config = json.loads((full / "config.json").read_text())
    assert config["max_train_steps"] == 0 and config["validation_every"] == 2  # the preset's, until the plan
    checkpoints = sorted(checkpoint_step(p) for p in list_checkpoints(full / "checkpoints"))
    end = checkpoints[-1]
    progress = trainer_state(full / "checkpoints" / f"checkpoint-{end}")["progress"]
    assert progress["step"] == progress["planned_steps"] == end > 4  # past the preset's 4 steps
    log = (full / "train.log").read_text()
    first, every = map(int, re.search(r"the run ends at step (\d+); validation every (\d+) steps", log).groups())
    assert progress["validation_every"] == every == math.ceil(first / 3) != 2  # not the preset's interval
    validations = [h["step"] for h in json.loads((full / "validation_history.json").read_text())]
    # the preset's until the plan at step 5 (which has timed a validation already), then the spread ones
    assert validations == [2, 4, *(s for s in range(6, end) if s % every == 0), end]
    assert f"training ends at step {end}: the step count the time budget max_train_time=60s planned" in log
    assert f"{end}/{end} [" in capsys.readouterr().err  # the progress bar's total is the plan
    assert spent_at_the_end(full) == pytest.approx(60, abs=3)  # a tick a clock read: the plan's grain

    stopped_at = next(s for s in checkpoints if s > 5)  # after the plan
    resumed = tmp_path / "resumed" / "run"
    shutil.copytree(full, resumed)
    for path in [*resumed.glob("final_model.*"), resumed / "finished.json"]:
        path.unlink()
    for step in checkpoints[checkpoints.index(stopped_at) + 1 :]:
        shutil.rmtree(resumed / "checkpoints" / f"checkpoint-{step}")
    checkpoint = resumed / "checkpoints" / f"checkpoint-{stopped_at}"
    train_on_ticks(monkeypatch, tmp_path / "resumed", demo_clips, *BUDGET, f"--resume={checkpoint}")
    last = max(checkpoint_step(p) for p in list_checkpoints(resumed / "checkpoints"))
    ending = trainer_state(resumed / "checkpoints" / f"checkpoint-{last}")["progress"]
    assert ending["planned_steps"] == last and ending["validation_every"] == every
    assert spent_at_the_end(resumed) == pytest.approx(60, abs=3)
    # its own start-up took the time of a few steps
    assert end - 4 <= last <= end
