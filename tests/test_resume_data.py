"""A resume notices when its run's data changed: every checkpoint records the clips the run
started with (their count and hash, ``training/state/run_data.py``), and a resume onto other
clips is refused in one line unless ``--allow_data_change=true``, which lists the change
with the resume's other changes and, when the validation clips changed, restarts the
best-model comparison. And the refusal to extend a finished budget run quotes the run's
own budget. One run of the test preset, on its own copies of the annotation files, stopped
at step 2 (its last checkpoint and final files removed), serves the data tests."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from taehv_train.base.errors import UserError
from train_runs import train_here

pytestmark = pytest.mark.slow  # training runs


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, demo_clips) -> tuple[Path, dict]:
    """(a 4-step run stopped at step 2, the data options it was started with: 5 training clips, 1 held out)."""
    root = tmp_path_factory.mktemp("resume_data")
    data = {"root": demo_clips["root"], "train": root / "train.json", "val": root / "val.json"}
    for part in ("train", "val"):
        shutil.copy(demo_clips[part], data[part])
    run = train_here(root / "out", data)
    leftovers = ("final_model.pth", "final_model.safetensors", "export", "finished.json", "checkpoints/checkpoint-4")
    for leftover in leftovers:
        path = run / leftover
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return run, data


def entries(path: Path) -> list[dict]:
    return json.loads(path.read_text())["list"]


def write_entries(path: Path, items: list[dict]) -> None:
    path.write_text(json.dumps({"total": len(items), "list": items}))


@contextmanager
def changed(path: Path, items: list[dict]) -> Iterator[None]:
    """``path`` holding ``items`` for the block, then as it was."""
    before = path.read_text()
    write_entries(path, items)
    try:
        yield
    finally:
        path.write_text(before)


def resume(run: Path, data: dict, *overrides: str) -> Path:
    return train_here(run.parent, data, "--resume", "latest", *overrides)


def test_a_resume_onto_other_clips_is_refused_before_anything_is_written(stopped):
    run, data = stopped
    train = entries(data["train"])
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))
    cases = {  # clips added to the folder and annotated again; clips removed; other clips, as many
        "training clips 5 -> 6": (data["train"], [*train, train[0]]),
        "training clips 5 -> 4": (data["train"], train[:4]),
        "validation clips 1, others than before": (data["val"], train[:1]),
    }
    for change, (path, items) in cases.items():
        with changed(path, items), pytest.raises(UserError) as refusal:
            resume(run, data)
        message = str(refusal.value)
        assert f"the data of {run} changed since it started ({change} ({path}))" in message, message
        assert "--allow_data_change=true" in message and "\n" not in message
        assert ("score its best model on another validation set" in message) == (path == data["val"]), message
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before


def test_data_that_is_missing_or_unreadable_on_resume_is_one_line(stopped, tmp_path):
    run, data = stopped
    data["val"].rename(tmp_path / "val.json")
    try:
        with pytest.raises(UserError, match=f"val_annotation_file: {data['val']} does not exist"):
            resume(run, data)
    finally:
        (tmp_path / "val.json").rename(data["val"])
    with changed(data["train"], []):
        data["train"].write_text('{"list": [')  # cut off
        with pytest.raises(UserError, match=f"cannot read the training clips of {data['train']}: "):
            resume(run, data)


def test_an_allowed_change_is_listed_and_restarts_the_best_model_comparison_on_new_validation_clips(stopped):
    run, data = stopped
    train, val = entries(data["train"]), entries(data["val"])
    write_entries(data["train"], [*train, train[0]])
    write_entries(data["val"], [*val, train[1]])
    resume(run, data, "--allow_data_change=true")

    log = (run / "train.log").read_text()
    assert (
        f"changed on resume: data: training clips 5 -> 6 ({data['train']}), data: validation clips 1 -> 2 "
        f"({data['val']}), data: the best-model comparison restarts" in log
    ), log
    assert "the validation clips changed: the best-model comparison restarts at step 2" in log
    # the first validation on the new clips is the best model, whatever the old clips scored
    assert json.loads((run / "best_model" / "model_info.json").read_text())["step"] == 4
    state = json.loads((run / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["best_model_since"] == 2 and [h["step"] for h in state["validation_history"]] == [2, 4]
    assert {part: record["clips"] for part, record in state["data"].items()} == {"train": 6, "val": 2}


def test_the_refusal_to_extend_a_finished_budget_run_quotes_its_own_budget(tmp_path, demo_clips):
    run = train_here(tmp_path, demo_clips, "--max_train_time=2s")  # spent at its first step
    step = json.loads((run / "finished.json").read_text())["step"]
    with pytest.raises(UserError) as refusal:
        checkpoint = run / "checkpoints" / f"checkpoint-{step}"
        train_here(tmp_path, demo_clips, "--resume", str(checkpoint), "--max_train_time=9m")
    assert (
        f"finished at step {step} (max_train_time=2s): give --max_train_steps above {step} and --max_train_time= "
        "(or more than its spent 2s) to extend it"
    ) in str(refusal.value)


def test_a_custom_config_file_runs_once_per_process(stopped, tmp_path):
    """A config file is Python code: a start that reads it twice (a resume checks it against
    the run's) runs it once."""
    run, data = stopped
    counted = tmp_path / "counted.py"
    counted.write_text(
        "from pathlib import Path\n"
        "from taehv_train.training.configs.taehv_config_test import config\n"
        "with open(Path(__file__).with_suffix('.runs'), 'a') as runs:\n"
        "    runs.write('ran\\n')\n"
    )
    checkpoint = run / "checkpoints" / "checkpoint-2"
    with pytest.raises(UserError, match="but this command uses"):  # the run was started with the test preset
        train_here(run.parent, data, "--resume", str(checkpoint), config=str(counted))
    assert (tmp_path / "counted.runs").read_text() == "ran\n"
