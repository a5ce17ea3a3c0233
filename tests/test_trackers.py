"""The trackers a run reports to (``report_to``, ``training/loop/trackers.py``): a run that
reports to MLflow (offline, in a file store) as well records the scalars TensorBoard records,
under the same tags at the same steps; an unknown tracker and one that is not installed are
one ``error:`` line and exit status 2 before any run folder."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import LoggerType
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import tool_exit
from taehv_train.common.config import TrainConfig, load_config
from taehv_train.training import taehv_train
from taehv_train.training.loop import trackers
from train_runs import TEST_CONFIG, train_here, training_options


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run_dir / "logs"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.slow  # a training run
def test_an_offline_mlflow_run_records_the_scalars_tensorboard_records(tmp_path, demo_clips, monkeypatch):
    client = mlflow_store(tmp_path, monkeypatch)
    # two steps: a loss log step, a validation and the run's end
    run_dir = train_here(tmp_path / "out", demo_clips, "--report_to=tensorboard,mlflow", "--max_train_steps=2")

    (run,) = client.search_runs([client.get_experiment_by_name(trackers.PROJECT).experiment_id])
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"
    assert run.data.params["report_to"] == "tensorboard,mlflow"  # the hyperparameters
    expected = tensorboard_scalars(run_dir)
    assert {"train/loss", "train/learning_rate", "val/psnr"} <= set(expected)
    recorded = {
        tag: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, tag), key=lambda m: m.step)]
        for tag in run.data.metrics
    }
    assert set(recorded) == set(expected)
    for tag, points in expected.items():  # TensorBoard keeps float32
        assert [step for step, _ in recorded[tag]] == [step for step, _ in points], tag
        assert [value for _, value in recorded[tag]] == pytest.approx([value for _, value in points], rel=1e-6), tag


def mlflow_store(tmp_path: Path, monkeypatch) -> MlflowClient:
    """An offline MLflow store in ``tmp_path`` that the run's tracker writes into."""
    store = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # recent MLflow asks for a database otherwise
    return MlflowClient(store)


def test_a_run_without_tensorboard_writes_no_event_file_and_reports_its_validation(tmp_path, monkeypatch):
    """The reconstruction strip is TensorBoard's alone: without it the strip is left out."""
    from accelerate import Accelerator

    from taehv_train.training.loop.monitoring import Monitor

    client = mlflow_store(tmp_path, monkeypatch)
    config = load_config(TEST_CONFIG).replace(report_to="mlflow")
    accelerator = Accelerator(cpu=True, log_with=trackers.log_with(config, tmp_path), project_dir=str(tmp_path))
    monitor = Monitor(accelerator, config, tmp_path)
    monitor.log_validation(2, {"val/psnr": 20.0, "strip": torch.zeros(3, 4, 4)}, draw=True)
    accelerator.end_training()
    (run,) = client.search_runs([client.get_experiment_by_name(trackers.PROJECT).experiment_id])
    assert run.data.metrics == {"val/psnr": 20.0} and run.data.params["report_to"] == "mlflow"
    assert not (tmp_path / "logs").exists()


def error_line(capsys, out: Path, clips: dict, report_to: str) -> str:
    """The one line training ends in for ``--report_to=report_to``, asserting exit status 2,
    no traceback and no output folder."""
    status, _, lines = tool_exit(capsys, taehv_train.main, *training_options(out, clips, f"--report_to={report_to}"))
    errors = [line for line in lines if line.startswith("error: ")]
    assert status == 2 and len(errors) == 1 and not any("Traceback" in line for line in lines), lines
    assert not out.exists()
    return errors[0]


def test_an_unknown_tracker_is_one_line_naming_the_known_ones(tmp_path, capsys, demo_clips):
    line = error_line(capsys, tmp_path / "out", demo_clips, "tensorboard,tensorbord")
    assert (
        line
        == "error: invalid config: report_to: unknown tracker 'tensorbord'; expected all or one of "
        + ", ".join(trackers.INSTALL)
    )


def test_a_tracker_that_is_not_installed_is_one_line_naming_its_pip_command(tmp_path, capsys, demo_clips, monkeypatch):
    monkeypatch.setattr(trackers, "get_available_trackers", lambda: [LoggerType.TENSORBOARD])  # wandb is missing
    line = error_line(capsys, tmp_path / "out", demo_clips, "tensorboard, wandb")
    assert line == "error: invalid config: report_to: wandb is not installed: pip install wandb"


def test_a_tracker_this_accelerate_does_not_integrate_names_the_upgrade(monkeypatch):
    older = [name for name in LoggerType.list() if name != "trackio"]  # an Accelerate from before trackio
    monkeypatch.setattr(trackers, "LoggerType", SimpleNamespace(list=lambda: older))
    assert trackers.config_errors(TrainConfig(report_to="trackio")) == [
        "report_to: this Accelerate does not integrate trackio yet: pip install -U accelerate"
    ]


def test_all_stands_for_every_installed_tracker_and_a_name_counts_once():
    assert trackers.tracker_names(TrainConfig(report_to="all")) == trackers.installed()
    assert {"tensorboard", "mlflow"} <= set(trackers.installed())  # the test dependencies
    assert trackers.tracker_names(TrainConfig(report_to="mlflow, tensorboard,mlflow")) == ["mlflow", "tensorboard"]
    assert trackers.config_errors(TrainConfig(report_to=" , ")) == [
        "report_to is empty: name a tracker, e.g. tensorboard"
    ]
