"""What a short run says and logs: the line a run far below its preset's steps gets (the
measured table, the same in docs/training.md), and the loss log interval a run of known
length gets."""

from __future__ import annotations

import re

import pytest

from conftest import REPO_ROOT
from taehv_train.common.config import load_config
from taehv_train.training.loop.expectations import EXPECTATIONS, Expectation, duration_text, short_run_warning
from taehv_train.training.loop.monitoring import LOG_POINTS, log_interval
from train_runs import SCRATCH_AT_TEST_SIZES, SCRATCH_CONFIG, TEST_CONFIG, train_here


def test_the_table_in_the_docs_is_the_one_in_the_code():
    doc = (REPO_ROOT / "docs" / "training.md").read_text()
    section = doc[doc.index("## What a run reaches") :]
    for name, expectation in EXPECTATIONS.items():
        row = next(line for line in section.splitlines() if line.startswith(f"| `{name}` |"))
        cells = [cell.strip() for cell in row.split("|")]
        assert cells[3] == f"~{expectation.needs}", name
        assert cells[4] == ", ".join(f"{steps}: {psnr:.1f}" for steps, psnr in expectation.curve), name


def test_what_a_preset_reaches_between_its_measurements():
    expectation = Expectation(1000, ((100, 15.0), (1000, 20.0)))
    assert expectation.psnr_at(50) == ("under ", 15.0)
    assert expectation.psnr_at(100) == ("~", 15.0)
    assert expectation.psnr_at(316) == pytest.approx(("~", 17.5), abs=0.01)  # half-way in log-steps
    assert expectation.psnr_at(5000) == ("~", 20.0)


@pytest.mark.parametrize("seconds, text", [(20, "1m"), (300, "5m"), (3600, "1h"), (8900, "2h29m")])
def test_durations_are_written_as_a_budget_is_typed(seconds, text):
    assert duration_text(seconds) == text


def test_a_run_far_below_its_presets_steps_says_what_it_reaches_and_what_to_change():
    scratch = load_config(SCRATCH_CONFIG, ["--max_train_time=5m"])
    line = short_run_warning(scratch, 34, 300.0)
    assert line == (
        "this run trains 34 steps: the scratch preset reaches under 15 dB held-out PSNR there, and a useful model "
        "(~20 dB) needs ~1000 steps (docs/training.md, 'What a run reaches'); at this machine's speed that is "
        "~2h28m: raise --max_train_time to it or train on a GPU"
    )
    assert "reaches ~19 dB" in short_run_warning(scratch, 400, 300.0)
    assert short_run_warning(scratch, 500, 300.0) is None  # half of what it needs: not far below
    assert short_run_warning(load_config(TEST_CONFIG), 4) is None  # no measurement for the preset
    demo = load_config(str(REPO_ROOT / "training" / "configs" / "taehv_config_demo.py"), ["--max_train_steps=300"])
    assert short_run_warning(demo, 300).endswith("; raise --max_train_steps to ~2600")


@pytest.mark.parametrize(
    "configured, last_step, typed, every",
    [
        (10, 34, False, 1),  # 34 logged losses, not 3
        (10, 100, False, 2),
        (10, 500, False, 10),  # the config's interval gives 50 already
        (10, None, False, 10),  # a budget before its plan: the length is not known yet
        (10, 34, True, 10),  # typed on the command line: as typed
    ],
)
def test_the_loss_is_logged_about_40_times_unless_the_interval_was_typed(configured, last_step, typed, every):
    assert log_interval(configured, last_step, typed) == every
    if last_step and not typed:
        assert last_step // every >= min(LOG_POINTS, last_step)


def test_a_run_of_a_few_steps_of_the_scratch_preset_says_so_and_logs_every_step(tmp_path, demo_clips):
    """Through the training entry point (in this process): the line at the start, and a loss
    log line at every one of its 3 steps (the preset's log_every is 10)."""
    overrides = [*SCRATCH_AT_TEST_SIZES, "--max_train_steps=3", "--validation_every=3", "--run_name=run"]
    run = train_here(tmp_path, demo_clips, *overrides, config=SCRATCH_CONFIG)
    log = (run / "train.log").read_text()
    warning = "WARNING taehv_train.training.loop.expectations: this run trains 3 steps"
    assert f"{warning}: the scratch preset reaches under 15 dB" in log
    assert "raise --max_train_steps to ~1000" in log
    assert re.findall(r"step (\d+): loss", log) == ["1", "2", "3"]
