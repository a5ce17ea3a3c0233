"""The time budget (``max_train_time``): the run's length, its plan, the intervals it
spreads, and the learning-rate schedules it adjusts."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from diffusers.optimization import get_scheduler

from taehv_train.common.config import TrainConfig, load_config
from taehv_train.training.loop import optimisation, time_budget
from taehv_train.training.loop.optimisation import LearningRateSchedule, parse_duration
from taehv_train.training.loop.time_budget import Cadence, TimeBudget, keeps_plan
from taehv_train.training.state.checkpoints import checkpoint_step, list_checkpoints
from taehv_train.training.state.run_config import Start, config_for_resume, describe_start
from train_runs import TEST_CONFIG, assert_identical, train_here


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


def fresh_progress() -> SimpleNamespace:
    return SimpleNamespace(step=0, train_seconds=0.0, planned_steps=0, validation_every=0)


def budget_config(**changes) -> TrainConfig:
    defaults = dict(max_train_time="100s", max_train_steps=0, validation_every=1000, checkpointing_steps=1000)
    return TrainConfig(**{**defaults, **changes})


def steps(budget: TimeBudget, clock: Clock, seconds: list[float], aside: dict[int, float] = ()) -> list[tuple]:
    """Steps of ``seconds`` each (and ``aside[step]`` seconds of validation or checkpoint
    after them); what ``check`` says after each."""
    said = []
    for duration in seconds:
        clock.now += duration
        budget.progress.step += 1
        budget.account()
        if budget.progress.step in aside:
            with budget.aside() as watch:
                clock.now += aside[budget.progress.step]
            assert watch.seconds == aside[budget.progress.step]
        said.append(budget.check())
    return said


def test_a_budget_plans_its_steps_and_spreads_its_validations_once_measured(clock):
    clock.now = 10.0  # 10 s of start-up before the first step
    progress = fresh_progress()
    schedule = LearningRateSchedule("cosine", 0, 0)
    budget = TimeBudget(budget_config(validations_per_budget=4), progress, schedule, 2, 0.0, CPU)
    assert budget.last_step is None and not budget.reached(10**6)  # no step limit: the plan will say
    # two slow first steps, then 3 s a step; a 5 s checkpoint after step 3 is not a step's time
    said = steps(budget, clock, [6, 6, 3, 3, 3], aside={3: 5})
    assert said == [(False, False)] * 4 + [(False, True)]  # 3 steps measured, 9 s >= 2% of the budget
    with budget.aside():  # the validation at the planning step measures what one costs
        clock.now += 4
    # 100 - 40 s left, 4 validations of 4 s to come: 44 s for steps of 3 s, 14 more steps
    assert budget.plan(4.0) == 19 == progress.planned_steps == budget.last_step
    assert progress.validation_every == 5 and budget.cadence == Cadence(5, 5, 5)
    assert schedule.total == 2 * 19
    assert progress.train_seconds == 40
    clock.now += 1000  # from the plan on, the step count alone ends the run
    assert steps(budget, clock, [1]) == [(False, False)]
    assert not budget.reached(18) and budget.reached(19)
    assert budget.ending(19, spent=False) == (
        "the step count the time budget max_train_time=100s planned is reached (1041 s of 100 s spent)"
    )

    # a resumed run keeps the plan and counts the seconds spent before
    clock.now = 0.0
    resumed = TimeBudget(budget_config(validations_per_budget=4), progress, schedule, 2, 0.0, CPU)
    clock.now = 1.0
    assert resumed.check() == (False, False) and resumed.last_step == 19 and math.isclose(resumed.spent(), 1042)


def test_without_spreading_the_plan_counts_the_configs_validations(clock):
    progress = fresh_progress()
    config = budget_config(validations_per_budget=0, validation_every=2)
    budget = TimeBudget(config, progress, LearningRateSchedule("constant", 0, 0), 1, 0.0, CPU)
    assert steps(budget, clock, [1, 1, 3, 3, 3])[-1] == (False, True)
    # 100 - 11 s left; a step costs 3 s and half a validation of 4 s: 17 more steps
    assert budget.plan(4.0) == 22 and progress.validation_every == 0
    assert budget.cadence == Cadence.of(config) == Cadence(2, 1000, 1000)


def test_a_step_limit_set_with_the_budget_caps_its_plan(clock):
    progress = fresh_progress()
    budget = TimeBudget(budget_config(max_train_steps=8), progress, LearningRateSchedule("constant", 0, 8), 1, 0.0, CPU)
    assert budget.last_step == 8
    assert steps(budget, clock, [1] * 5)[-1] == (False, True)
    assert budget.plan(0.0) == 8
    assert budget.ending(8, spent=False) == "max_train_steps=8 is reached, before the time budget max_train_time=100s"


def test_a_budget_spent_before_its_plan_ends_the_run(clock):
    progress = fresh_progress()
    budget = TimeBudget(budget_config(), progress, LearningRateSchedule("constant", 0, 0), 1, 0.0, CPU)
    assert steps(budget, clock, [150]) == [(True, False)]
    assert budget.ending(1, spent=True) == "the time budget max_train_time=100s is spent"
    no_budget = TimeBudget(TrainConfig(max_train_steps=3), fresh_progress(), budget.schedule, 1, 0.0, CPU)
    assert steps(no_budget, clock, [10**6] * 3) == [(False, False)] * 3 and no_budget.reached(3)
    assert no_budget.ending(3, spent=False) == "max_train_steps=3 is reached"


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


BUDGET = ["--max_train_time=60s", "--validations_per_budget=3", "--checkpoints_total_limit=100", "--run_name=run"]


@pytest.mark.slow  # two training runs
def test_a_budget_alone_is_the_runs_length_and_a_resume_after_its_plan_ends_where_it_would(
    monkeypatch, capsys, tmp_path, demo_clips
):
    """The test preset stops at step 4; typed alone, the budget outlasts it: the run measures
    its steps until step 5, validates there, plans its end and spreads its validations,
    image strips and checkpoints over it; the progress bar counts to the plan. Stopped
    after the plan (its last checkpoints and ending taken away, as a kill leaves it) and
    resumed, it ends at the same step with the same weights and validations."""
    full = train_on_ticks(monkeypatch, tmp_path / "full", demo_clips, *BUDGET)
    config = json.loads((full / "config.json").read_text())
    assert config["max_train_steps"] == 0 and config["validation_every"] == 2  # the preset's, until the plan
    checkpoints = sorted(checkpoint_step(p) for p in list_checkpoints(full / "checkpoints"))
    planned = checkpoints[-1]
    progress = trainer_state(full / "checkpoints" / f"checkpoint-{planned}")["progress"]
    assert progress["step"] == progress["planned_steps"] == planned > 4  # past the preset's 4 steps
    every = progress["validation_every"]
    spread = [s for s in range(6, planned) if s % every == 0]
    assert every == math.ceil(planned / 3) != 2 and spread  # not the preset's interval
    validations = [h["step"] for h in json.loads((full / "validation_history.json").read_text())]
    assert validations == [2, 4, 5, *spread, planned]
    # checkpoints every validation interval (the preset's ratio, 2 to 2), from the planning step on
    assert checkpoints == [2, 4, *(s for s in range(5, planned) if s % every == 0), planned]
    log = (full / "train.log").read_text()
    assert f"the run ends at step {planned}; validation every {every} steps" in log
    assert f"training ends at step {planned}: the step count the time budget max_train_time=60s planned" in log
    assert f"{planned}/{planned} [" in capsys.readouterr().err  # the progress bar's total is the plan

    stopped_at = spread[0]
    resumed = tmp_path / "resumed" / "run"
    shutil.copytree(full, resumed)
    for path in [*resumed.glob("final_model.*"), resumed / "finished.json"]:
        path.unlink()
    for step in checkpoints[checkpoints.index(stopped_at) + 1 :]:
        shutil.rmtree(resumed / "checkpoints" / f"checkpoint-{step}")
    checkpoint = resumed / "checkpoints" / f"checkpoint-{stopped_at}"
    train_on_ticks(monkeypatch, tmp_path / "resumed", demo_clips, *BUDGET, f"--resume={checkpoint}")
    assert_identical(full / "final_model.safetensors", resumed / "final_model.safetensors")
    assert (full / "validation_history.json").read_text() == (resumed / "validation_history.json").read_text()
    ends = [trainer_state(run / "checkpoints" / f"checkpoint-{planned}")["progress"] for run in (full, resumed)]
    assert ends[1] == {**ends[0], "train_seconds": ends[1]["train_seconds"]}  # seconds: two start-ups
