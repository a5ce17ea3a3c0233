"""Checkpoint building blocks: pickle-free state files, atomic writes, finding checkpoints,
the best-model tracker and the fault plan."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator

from training.best_model import BestTracker
from training.checkpointing import (
    CHECKPOINT_MANIFEST,
    list_checkpoints,
    rng_state,
    remove_partial_checkpoints,
    resolve_resume,
    set_rng_state,
    write_atomically,
)
from training.config import ConfigError, TrainConfig
from training.resilience import FaultPlan, agree
from training.state_io import load_tree, save_tree


def test_optimizer_state_round_trips_without_pickle(tmp_path):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    files = save_tree(tmp_path / "optimizer", optimizer.state_dict())
    assert sorted(p.name for p in files) == ["optimizer.json", "optimizer.safetensors"]
    restored = load_tree(tmp_path / "optimizer")
    assert restored["param_groups"][0]["betas"] == (0.9, 0.95)  # tuples stay tuples
    assert set(restored["state"]) == {0, 1}  # int keys stay ints
    fresh = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=1e-3)
    fresh.load_state_dict(restored)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(fresh.state_dict()["state"][0][key], optimizer.state_dict()["state"][0][key])


def test_rng_states_round_trip(tmp_path):
    generator = torch.Generator().manual_seed(3)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    save_tree(tmp_path / "rng", rng_state(generator))
    expected = (random.random(), np.random.rand(), torch.rand(1), torch.rand(1, generator=generator))
    random.seed(9), np.random.seed(9), torch.manual_seed(9), generator.manual_seed(9)
    set_rng_state(load_tree(tmp_path / "rng"), generator)
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(1), expected[2]) and torch.equal(torch.rand(1, generator=generator), expected[3])


def test_objects_that_need_pickle_are_refused(tmp_path):
    with pytest.raises(TypeError, match="without pickle"):
        save_tree(tmp_path / "bad", {"scaler": object()})
    with pytest.raises(TypeError, match="neither str nor int"):
        save_tree(tmp_path / "bad", {(1, 2): 3})


def _accelerator() -> Accelerator:
    return Accelerator(cpu=True)


def _complete(directory: Path, step: int) -> Path:
    return write_atomically(_accelerator(), directory / f"checkpoint-{step}",
                            lambda tmp: (tmp / "model.safetensors").write_bytes(b"x" * step), {"step": step})


def test_atomic_write_failure_leaves_previous_checkpoints_valid(tmp_path):
    _complete(tmp_path, 1)

    def crash(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(_accelerator(), tmp_path / "checkpoint-2", crash, {"step": 2})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1"]
    remove_partial_checkpoints(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


def test_error07_incomplete_or_damaged_checkpoints_are_never_latest(tmp_path):
    _complete(tmp_path, 1)
    _complete(tmp_path, 2)
    (tmp_path / "checkpoint-3").mkdir()  # an old-style or interrupted folder: no manifest
    (tmp_path / "checkpoint-2" / "model.safetensors").write_bytes(b"truncated")  # wrong size
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1"]
    manifest = json.loads((tmp_path / "checkpoint-1" / CHECKPOINT_MANIFEST).read_text())
    assert manifest["files"] == {"model.safetensors": 1} and manifest["step"] == 1


def _config(tmp_path: Path, **changes) -> TrainConfig:
    return TrainConfig(output_dir=str(tmp_path), config_file="taehv_config_h100.py").replace(**changes)


def test_error09_resume_resolution(tmp_path):
    old, new = tmp_path / "h100_2026-01-01_00-00-00", tmp_path / "h100_2026-02-01_00-00-00"
    for run, steps in ((old, (5, 10)), (new, (3,))):
        for step in steps:
            _complete(run / "checkpoints", step)
    assert resolve_resume(_config(tmp_path, resume_from_checkpoint="latest")) == (new, new / "checkpoints/checkpoint-3")
    assert resolve_resume(_config(tmp_path, resume_from_checkpoint="checkpoint-3"))[1] == new / "checkpoints/checkpoint-3"
    given = str(old / "checkpoints" / "checkpoint-5")
    assert resolve_resume(_config(tmp_path, resume_from_checkpoint=given)) == (old, Path(given))  # its own run dir
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_resume(_config(tmp_path, resume_from_checkpoint=str(old / "checkpoints" / "checkpoint-7")))
    (old / "checkpoints" / "checkpoint-20").mkdir()
    with pytest.raises(ConfigError, match="incomplete"):
        resolve_resume(_config(tmp_path, resume_from_checkpoint=str(old / "checkpoints" / "checkpoint-20")))
    assert resolve_resume(_config(tmp_path / "empty", auto_resume=True)) == (None, None)  # fresh start
    assert resolve_resume(_config(tmp_path, auto_resume=True))[1] == new / "checkpoints/checkpoint-3"
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        resolve_resume(_config(tmp_path / "empty", resume_from_checkpoint="latest"))


def test_best_tracker_directions_patience_and_replay():
    tracker = BestTracker("val/psnr", patience=2, min_delta=0.1)
    assert tracker.update(2, {"val/psnr": 20.0, "val/mse": 0.01})
    assert not tracker.update(4, {"val/psnr": 20.05, "val/mse": 0.009})  # below min_delta
    assert not tracker.should_stop
    assert not tracker.update(6, {"val/psnr": float("nan"), "val/mse": 0.02})
    assert tracker.should_stop and (tracker.best_step, tracker.best_value) == (2, 20.0)
    replayed = BestTracker.replay(tracker.history, "val/psnr", 2, 0.1)
    assert (replayed.best_step, replayed.bad_validations) == (2, 2)
    by_mse = BestTracker.replay(tracker.history, "val/mse", 0, 0.0)  # lower is better
    assert by_mse.best_step == 4 and not by_mse.should_stop
    with pytest.raises(KeyError, match="val/ssim"):
        BestTracker("val/ssim").update(2, {"val/psnr": 1.0})


def test_fault_plan():
    plan = FaultPlan.parse("nan_loss@3:1, oom@5-6, sigterm@2")
    assert plan.fires("nan_loss", 3, 1) and not plan.fires("nan_loss", 3, 0)
    assert plan.fires("oom", 6, 0) and not plan.fires("oom", 7, 0)
    with pytest.raises(torch.OutOfMemoryError):
        plan.inject_forward(5, 0, torch.tensor(1.0))
    assert torch.isnan(plan.inject_forward(3, 1, torch.tensor(1.0)))
    for bad in ("nan_loss", "boom@3", "oom@x"):
        with pytest.raises(ConfigError, match="fault_injection"):
            FaultPlan.parse(bad)
    assert agree([True, False], torch.device("cpu")) == [True, False]  # one process: its own flags
