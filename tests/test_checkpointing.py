"""Checkpoint building blocks: pickle-free state files, atomic writes, finding checkpoints,
the best-model tracker and the fault plan."""

from __future__ import annotations

import json
import random
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator

from conftest import REPO_ROOT
from taehv_train.base.errors import UserError
from taehv_train.common.config import TrainConfig, load_config
from taehv_train.common.run_files import CHECKPOINT_MANIFEST, finished_info, write_run_marker
from taehv_train.training.loop.best_model import BestTracker
from taehv_train.training.loop.resilience import FaultPlan, agree
from taehv_train.training.state.atomic_folders import DiskFullError, is_disk_full, write_atomically
from taehv_train.training.state.checkpoints import remove_partial_checkpoints, rng_state, set_rng_state
from taehv_train.training.state.run_config import describe_start, start_of
from taehv_train.training.state.run_folders import list_checkpoints, resolve_resume
from taehv_train.training.state.serialisation import load_tree, save_tree


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


def _complete(directory: Path, step: int, variant: str = "taecvx", config_file: str | None = None) -> Path:
    """A complete checkpoint; ``config_file``: the config its run recorded (None: none recorded)."""
    recorded = {"variant": variant} if config_file is None else {"variant": variant, "config_file": config_file}

    def write(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"x" * step)
        (tmp / "trainer_state.json").write_text(json.dumps({"config": recorded}))

    return write_atomically(_accelerator(), directory / f"checkpoint-{step}", write, {"step": step})


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


def test_incomplete_or_damaged_checkpoints_are_never_latest(tmp_path):
    _complete(tmp_path, 1)
    _complete(tmp_path, 2)
    (tmp_path / "checkpoint-3").mkdir()  # an old-style or interrupted folder: no manifest
    (tmp_path / "checkpoint-2" / "model.safetensors").write_bytes(b"truncated")  # wrong size
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1"]
    manifest = json.loads((tmp_path / "checkpoint-1" / CHECKPOINT_MANIFEST).read_text())
    assert manifest["files"]["model.safetensors"] == {"size": 1, "crc32": f"{zlib.crc32(b'x'):08x}"}
    assert manifest["step"] == 1


def test_same_size_damage_is_caught_before_a_resume(tmp_path):
    """Bytes overwritten in place keep the size: the checksum catches them, "latest" passes
    over the damaged checkpoint, and naming it is an error that names the one before."""
    run = tmp_path / "h100_2026-01-01_00-00-00"
    for step in (2, 4, 6):
        _complete(run / "checkpoints", step)
    damaged = run / "checkpoints" / "checkpoint-6" / "model.safetensors"
    damaged.write_bytes(b"y" * 6)  # same size, other bytes
    assert [p.name for p in list_checkpoints(run / "checkpoints")][-1] == "checkpoint-6"  # sizes alone pass
    assert resolve_resume(_config(tmp_path, resume_from_checkpoint="latest"))[1] == run / "checkpoints/checkpoint-4"
    with pytest.raises(
        UserError, match=r"checkpoint-6 is damaged \(model.safetensors checksum\); resume from checkpoint-4"
    ):
        resolve_resume(_config(tmp_path, resume_from_checkpoint="checkpoint-6"))


def test_a_damaged_file_is_refused_even_when_written_before_checksums(tmp_path):
    _complete(tmp_path / "run" / "checkpoints", 2)
    manifest_file = tmp_path / "run" / "checkpoints" / "checkpoint-2" / CHECKPOINT_MANIFEST
    manifest = json.loads(manifest_file.read_text())
    manifest["files"] = {name: entry["size"] for name, entry in manifest["files"].items()}  # older format: sizes
    manifest_file.write_text(json.dumps(manifest))
    assert resolve_resume(_config(tmp_path, run_name="run", resume_from_checkpoint="latest"))[1].name == "checkpoint-2"


def test_a_bare_checkpoint_name_is_looked_up_in_the_runs_that_hold_it(tmp_path):
    """A start that failed left a newer run folder without checkpoints: it is passed over."""
    old = tmp_path / "h100_2026-01-01_00-00-00"
    _complete(old / "checkpoints", 4)
    (tmp_path / "h100_2026-02-01_00-00-00").mkdir()  # a failed start: config.json and train.log only
    assert resolve_resume(_config(tmp_path, resume_from_checkpoint="checkpoint-4")) == (
        old,
        old / "checkpoints/checkpoint-4",
    )
    with pytest.raises(UserError, match="no run of this config .* holds checkpoint-5"):
        resolve_resume(_config(tmp_path, resume_from_checkpoint="checkpoint-5"))


def test_a_checkpoint_of_another_variant_is_refused_naming_both(tmp_path):
    """The variant is the run's: a preset of another variant resumes it as it is, a
    --variant typed on the resume line is refused."""
    _complete(tmp_path / "run" / "checkpoints", 2, variant="taecvx")
    base = _config(tmp_path, run_name="run", variant="taehv", resume_from_checkpoint="latest")
    assert start_of(base, []).config.variant == "taecvx"
    with pytest.raises(
        UserError, match="holds a taecvx model but this resume asks for --variant=taehv.*--variant=taecvx"
    ):
        start_of(base, ["--variant=taehv"])


def test_latest_passes_over_finished_runs_which_resume_by_path_only_to_extend_them(tmp_path):
    """Finished: the marker training writes at its end, or (runs from before it) a
    final_model.safetensors newer than the newest checkpoint. An extension marks the run
    unfinished until its new end."""
    old, legacy, new = (tmp_path / f"h100_2026-0{month}-01_00-00-00" for month in (1, 2, 3))
    _complete(old / "checkpoints", 4)
    _complete(legacy / "checkpoints", 4)
    (legacy / "final_model.safetensors").write_bytes(b"w")
    newest = _complete(new / "checkpoints", 2)
    write_run_marker(new, {"step": 2, "reason": "finished", "max_train_steps": 2})
    assert (finished_info(legacy), finished_info(old)) == ({"step": 4, "reason": "finished"}, None)
    start = start_of(_config(tmp_path, resume_from_checkpoint="latest"), [])
    assert (start.run, start.checkpoint, start.step, start.extending) == (
        old,
        old / "checkpoints/checkpoint-4",
        4,
        False,
    )
    by_path = _config(tmp_path, resume_from_checkpoint=str(newest), max_train_steps=2)
    with pytest.raises(
        UserError, match=rf"^{new} finished at step 2 \(max_train_steps=2\): give --max_train_steps above 2"
    ):
        start_of(by_path, [])
    extended = start_of(by_path.replace(max_train_steps=3), ["--max_train_steps=3"])
    assert extended.extending and extended.changes == () and "extending it" in describe_start(extended)
    write_run_marker(new, {"reason": "extending", "step": 2})
    assert finished_info(new) is None
    write_run_marker(new, {"step": 3, "reason": "finished", "max_train_steps": 3})
    shutil.rmtree(old)
    with pytest.raises(UserError, match=r"--resume latest: every h100 run under .* is finished \(newest: "):
        start_of(_config(tmp_path, resume_from_checkpoint="latest"), [])
    assert start_of(_config(tmp_path, auto_resume=True), []).checkpoint is None  # a fresh run
    restarted = start_of(_config(tmp_path, run_name=legacy.name, auto_resume=True, max_train_steps=4), [])
    assert restarted.done and describe_start(restarted).startswith(f"nothing to do: {legacy} finished at step 4")


def test_a_full_disk_is_one_error_that_keeps_the_last_checkpoint(tmp_path):
    """The errors a full disk really raises (written to /dev/full) are recognised, and a
    failed save says where, how much is needed and how much is free."""
    (tmp_path / "full").symlink_to("/dev/full")
    with pytest.raises(OSError) as text_error:
        (tmp_path / "full").write_text("x" * 100_000)
    with pytest.raises(RuntimeError) as torch_error:
        torch.save({"a": torch.zeros(100_000)}, tmp_path / "full")
    assert is_disk_full(text_error.value) and is_disk_full(torch_error.value)
    assert not is_disk_full(OSError(2, "No such file or directory"))

    _complete(tmp_path / "checkpoints", 1)

    def write(tmp: Path) -> None:
        (tmp / "model.pth").symlink_to("/dev/full")
        torch.save({"a": torch.zeros(100_000)}, tmp / "model.pth")

    with pytest.raises(
        DiskFullError,
        match=r"no space left to save checkpoint-2 in .*checkpoints: it needs about "
        r"[0-9.]+ KiB and [0-9.]+ GiB are free; checkpoint-1 kept intact",
    ):
        write_atomically(
            _accelerator(), tmp_path / "checkpoints" / "checkpoint-2", write, {"step": 2}, expected_bytes=lambda: 2**40
        )  # a previous save's size wins over the estimate
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint-1"]  # no partial folder
    with pytest.raises(
        DiskFullError,
        match=r"no space left to save checkpoint-2 in .*fresh: it needs about 3\.0 MiB "
        r"and [0-9.]+ GiB are free; nothing was saved",
    ):  # the first save: the estimate
        write_atomically(
            _accelerator(), tmp_path / "fresh" / "checkpoint-2", write, {"step": 2}, expected_bytes=lambda: 3 * 2**20
        )


def test_the_size_of_a_checkpoint_is_estimated_from_the_state_it_saves(tmp_path):
    """What a first save needs, before anything was written: within a few per cent of
    what it then takes on disk."""
    from taehv_train.models.taehv import TAEHV
    from taehv_train.training.state.checkpoints import TrainingObjects, save_checkpoint, training_state_bytes

    model = TAEHV(variant="taehv")  # weights.safetensors records the variant
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():  # Adam moments exist after a first step
        p.grad = torch.randn_like(p)
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    objects = TrainingObjects(_accelerator(), model, optimizer, scheduler, None, torch.Generator())
    saved = save_checkpoint(objects, tmp_path, 1, 1, {"progress": {}}, FaultPlan())
    on_disk = sum(p.stat().st_size for p in saved.rglob("*") if p.is_file())
    assert 0.9 * on_disk < training_state_bytes(objects) <= on_disk


def _config(tmp_path: Path, **changes) -> TrainConfig:
    return TrainConfig(output_dir=str(tmp_path), config_file="taehv_config_h100.py").replace(**changes)


def test_resume_finds_the_checkpoints_own_run_folder_and_refuses_missing_ones(tmp_path):
    old, new = tmp_path / "h100_2026-01-01_00-00-00", tmp_path / "h100_2026-02-01_00-00-00"
    for run, steps in ((old, (5, 10)), (new, (3,))):
        for step in steps:
            _complete(run / "checkpoints", step)
    assert resolve_resume(_config(tmp_path, resume_from_checkpoint="latest")) == (new, new / "checkpoints/checkpoint-3")
    assert (
        resolve_resume(_config(tmp_path, resume_from_checkpoint="checkpoint-3"))[1] == new / "checkpoints/checkpoint-3"
    )
    given = str(old / "checkpoints" / "checkpoint-5")
    assert resolve_resume(_config(tmp_path, resume_from_checkpoint=given)) == (old, Path(given))  # its own run dir
    with pytest.raises(UserError, match="does not exist"):
        resolve_resume(_config(tmp_path, resume_from_checkpoint=str(old / "checkpoints" / "checkpoint-7")))
    (old / "checkpoints" / "checkpoint-20").mkdir()
    with pytest.raises(UserError, match="incomplete"):
        resolve_resume(_config(tmp_path, resume_from_checkpoint=str(old / "checkpoints" / "checkpoint-20")))
    assert resolve_resume(_config(tmp_path / "empty", auto_resume=True)) == (None, None)  # fresh start
    assert resolve_resume(_config(tmp_path, auto_resume=True))[1] == new / "checkpoints/checkpoint-3"
    with pytest.raises(UserError, match="no complete checkpoint"):
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
        with pytest.raises(UserError, match="fault_injection"):
            FaultPlan.parse(bad)
    assert agree([True, False], torch.device("cpu")) == [True, False]  # one process: its own flags


def _preset(name: str, *overrides: str) -> TrainConfig:
    """A preset as the command line loads it (its config_file as the launch script gives it)."""
    return load_config(REPO_ROOT / "training" / "configs" / f"taehv_config_{name}.py", list(overrides))


def test_a_resume_continues_its_run_under_its_own_preset_in_its_own_folder(tmp_path):
    """Key=value changes on the same preset resume (an output_dir/run_name that names the
    run's own folder included); another preset, or an output_dir/run_name given for
    another folder, is refused naming the run, its preset and both ways on."""
    run = tmp_path / "base"
    checkpoint = _complete(run / "checkpoints", 4, config_file="training/configs/taehv_config_test.py")
    resume = f"--resume_from_checkpoint={checkpoint}"
    for same in (
        [resume, "--max_train_steps=6", "--learning_rate=1e-4"],
        [resume, f"--output_dir={tmp_path}"],
        [resume, f"--output_dir={tmp_path}", "--run_name=base"],
        [f"--output_dir={tmp_path}", "--run_name=base", "--resume_from_checkpoint=latest"],
        [f"--output_dir={tmp_path}", "--run_name=base", "--auto_resume=true"],
    ):
        assert resolve_resume(_preset("test", *same)) == (run, checkpoint)
    ways_on = (
        r"Resume with the test preset \(--key=value changes allowed\) and no other --output_dir/--run_name, or "
        rf"start a new run from its weights with --pretrained_model_path={checkpoint}$"
    )
    for preset, overrides, conflict in (
        ("demo", [resume], "uses the demo preset"),
        ("test", [resume, f"--output_dir={tmp_path / 'new'}"], f"gives --output_dir={tmp_path / 'new'}"),
        ("test", [resume, "--run_name=other"], "gives --run_name=other"),
        ("demo", [f"--output_dir={tmp_path}", "--run_name=base", "--auto_resume=true"], "uses the demo preset"),
    ):
        with pytest.raises(UserError, match=rf"^{checkpoint} belongs to the run {run}, started with the test preset, "):
            resolve_resume(_preset(preset, *overrides))
        with pytest.raises(UserError, match=rf"but this command {conflict}: .*{ways_on}"):
            resolve_resume(_preset(preset, *overrides))


def test_a_checkpoint_that_recorded_no_config_file_resumes_under_any_preset(tmp_path):
    checkpoint = _complete(tmp_path / "old" / "checkpoints", 2)
    assert resolve_resume(_preset("demo", f"--resume_from_checkpoint={checkpoint}"))[1] == checkpoint


def test_a_file_given_to_resume_is_named_for_what_it_is_with_what_to_give_instead(tmp_path):
    """A weight file (the run's final model, a checkpoint's weights) or any other file is not
    a checkpoint: the message says so, how to start from the weights and which checkpoint
    folder continues the run."""
    run = tmp_path / "run"
    checkpoint = _complete(run / "checkpoints", 4)
    for name in ("final_model.safetensors", "final_model.pth", "config.json"):
        (run / name).write_text("{}")
    (checkpoint / "weights.safetensors").write_bytes(b"w")
    (tmp_path / "published.pth").write_bytes(b"w")

    def refusal(path: Path) -> str:
        with pytest.raises(UserError) as refused:
            resolve_resume(_config(tmp_path, resume_from_checkpoint=str(path)))
        return str(refused.value)

    for weights in (run / "final_model.safetensors", run / "final_model.pth"):
        assert refusal(weights) == (
            f"--resume {weights}: {weights} is a weight file, not a checkpoint folder: start a new run from these "
            f"weights with --pretrained_model_path={weights}, or continue its run with --resume {checkpoint}"
        )
    inside = checkpoint / "weights.safetensors"
    assert refusal(inside).endswith(
        f"is a weight file, not a checkpoint folder: start a new run from these weights with "
        f"--pretrained_model_path={inside}, or continue its run with --resume {checkpoint}"
    )
    for other in (run / "config.json", checkpoint / "trainer_state.json"):
        assert refusal(other) == (
            f"--resume {other}: {other} is a file, not a checkpoint folder: continue its run with --resume {checkpoint}"
        )
    assert refusal(tmp_path / "published.pth").endswith(
        "start a new run from these weights with "
        f"--pretrained_model_path={tmp_path / 'published.pth'}, or continue a run with "
        "--resume <run>/checkpoints/checkpoint-<step> (a checkpoint folder)"
    )
