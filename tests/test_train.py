"""End-to-end training runs on CPU: 1 process and 2-process DeepSpeed ZeRO-2 (2-process DDP
runs in test_fault_tolerance.py).

Each run is real (in this process where only its outputs matter, `train_here`), on a tiny
dataset made by the demo generator, with a tiny CogVideoX VAE saved by diffusers and loaded
through the real reference-VAE path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import REPO_ROOT
from taehv_train.base.errors import UserError
from taehv_train.common.metrics import lpips_unavailable_reason
from taehv_train.common.presets import preset_file
from taehv_train.models.taehv import TAEHV
from taehv_train.models.weights import save_weights
from taehv_train.training.demo_data import make_demo_dataset
from taehv_train.training.loop.validation import LABEL_HEIGHT
from train_runs import TEST_CONFIG, TRAIN, deepspeed_zero2, run_dir, train, train_here

pytestmark = pytest.mark.slow  # training processes


def scalars(run_dir: Path) -> dict[str, list[float]]:
    events = EventAccumulator(str(run_dir / "logs"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    values = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    values["__images__"] = events.Tags()["images"]
    return values


def reconstruction_image(run_dir: Path) -> np.ndarray:
    """The last ``val/reconstruction`` image TensorBoard holds, HWC uint8."""
    events = EventAccumulator(str(run_dir / "logs"), size_guidance={"images": 0})
    events.Reload()
    encoded = events.Images("val/reconstruction")[-1].encoded_image_string
    return cv2.imdecode(np.frombuffer(encoded, np.uint8), cv2.IMREAD_COLOR)


def assert_exported(run_dir: Path, variant: str = "taecvx") -> None:
    for name in ("final_model.pth", "final_model.safetensors"):
        model = TAEHV(run_dir / name, variant=variant)  # strict load of the published key format
        assert all(p.dtype == torch.float32 for p in model.parameters())


def test_single_process_with_reference_vae_bf16(tmp_path, demo_clips, tiny_cogvideox_vae):
    run = train_here(
        tmp_path,
        demo_clips,
        f"--ref_vae_path={tiny_cogvideox_vae}",
        "--ref_vae_dtype=fp32",
        "--mixed_precision=bf16",
        "--height=16",  # bf16 convolutions are slow on a CPU without native bf16
        "--width=16",
        "--num_validation_samples=1",
        "--max_train_steps=4",
        "--gradient_accumulation_steps=2",
    )
    assert_exported(run)
    logged = scalars(run)
    for tag in (
        "train/loss",
        "train/encoder_loss",
        "train/decoder_loss",
        "train/reconstruction_loss",
        "train/learning_rate",
        "train/gradient_norm",
        "train/host_memory_gb",
        "train/samples_per_second",
        "train/data_failures",
        "train/latent_rms_ratio",
        "val/psnr",
        "val/ssim",
        "val/mse",
        "val/psnr_from_reference_latents",
        "val/preview_psnr",  # the first latent decoded alone, as a sampler's live preview shows it
        "val/preview_ssim",
        "val/preview_psnr_from_reference_latents",
    ):
        assert tag in logged, tag
        assert all(v == v for v in logged[tag]), tag  # no NaN
    assert logged["val/preview_psnr"] != logged["val/psnr"]  # one frame's score, not the clip's
    validation = next(line for line in (run / "train.log").read_text().splitlines() if "validation: " in line)
    assert f"val/preview_psnr={logged['val/preview_psnr'][0]:.4f}" in validation
    assert ("train/gpu_memory_gb" in logged) == torch.cuda.is_available()  # host memory is not named GPU memory
    assert all(0 <= v <= 1 for v in logged["train/data_wait"])  # a share of each log interval's wall time
    assert all(v > 0 for v in logged["train/tflops"])  # the meta-device FLOP count of the steps trained
    cuda = torch.cuda.is_available()
    assert ("train/gpu_idle" in logged) == cuda and ("train/mfu" in logged) == cuda  # no GPU, no GPU figures
    line = r"step 4: loss \d\.\d{4}, [\d.]+ clips/s, data wait \d+%, .*TFLOP/s"  # the speed in the log line
    assert re.search(line, (run / "train.log").read_text())
    assert len(logged["train/loss"]) == 4 and "val/reconstruction" in logged["__images__"]
    strip = reconstruction_image(run)  # the input row and the decoded row, each under its label band
    height = json.loads((run / "config.json").read_text())["height"]
    assert strip.shape[0] == 2 * (height + LABEL_HEIGHT) and strip[:LABEL_HEIGHT].max() > 200
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert (run / "train.log").read_text().count("validation") >= 2
    assert '"ref_vae_path"' in (run / "config.json").read_text()
    log = (run / "train.log").read_text()  # a missing LPIPS: one line at start-up, before the first step's
    said = [line for line in log.splitlines() if "lpips is left out" in line.lower()]
    if (reason := lpips_unavailable_reason()) is None:
        assert said == [] and "val/lpips" in logged
    else:
        assert len(said) == 1 and said[0].endswith(f"val/lpips is left out: {reason}") and "val/lpips" not in logged
        assert log.index("val/lpips is left out") < re.search(r"step \d+: loss", log).start()


def test_deepspeed_zero2_two_processes_bf16_with_seraena(tmp_path, demo_clips, tiny_cogvideox_vae):
    """ZeRO-2 keeps the module in bf16; without EMA the export must be its fp32 master weights.
    DeepSpeed's CPU backend compiles no kernel for itself (training does not use it)."""
    extensions = tmp_path / "torch_extensions"
    train(
        deepspeed_zero2(29531),
        tmp_path,
        demo_clips,
        f"--ref_vae_path={tiny_cogvideox_vae}",
        "--use_seraena=true",
        "--train_batch_size=2",
        "--n_seraena_frames=9",
        "--max_train_steps=2",
        "--ref_vae_dtype=fp32",
        "--gradient_accumulation_steps=2",
        "--max_grad_norm=0.5",
        "--mixed_precision=bf16",
        "--height=16",  # bf16 convolutions are slow on a CPU without native bf16
        "--width=16",
        "--use_ema=false",
        env={"TORCH_EXTENSIONS_DIR": str(extensions)},
    )
    assert not extensions.exists() or not any(extensions.iterdir())
    run = run_dir(tmp_path)
    assert_exported(run)
    exported = load_file(str(run / "final_model.safetensors"))
    module = load_file(str(run / "checkpoints" / "checkpoint-2" / "model.safetensors"))
    assert {t.dtype for t in module.values()} == {torch.bfloat16}
    assert any(not torch.equal(t, t.bfloat16().float()) for t in exported.values())  # not a bf16 cast
    assert "2 process(es), DistributedType.DEEPSPEED" in (run / "train.log").read_text()
    logged = scalars(run)
    for tag in ("train/encoder_loss", "train/seraena_loss", "train/seraena_disc_loss"):
        assert tag in logged and all(v == v for v in logged[tag]), tag
    assert "Seraena: 7.5M parameters" in (run / "train.log").read_text()
    checkpoint = run / "checkpoints" / "checkpoint-2"  # ZeRO-2: one optimizer shard per rank, no pickles
    assert {p.name for p in checkpoint.iterdir()} >= {
        "optimizer_rank0.safetensors",
        "optimizer_rank1.safetensors",
        "rng_rank0.json",
        "rng_rank1.json",
        "model.safetensors",
        "seraena_rank0.safetensors",
        "seraena_rank1.safetensors",
    }
    assert not list(checkpoint.rglob("*.pkl")) and not list(checkpoint.rglob("*.pt"))


def test_loss_falls_when_overfitting_one_clip(tmp_path):
    clip = make_demo_dataset(tmp_path / "one", num_clips=2, n_frames=12, height=48, width=64, seed=3)
    one = {"root": tmp_path / "one", **clip}
    run = train_here(
        tmp_path / "out",
        one,
        "--max_train_steps=40",
        "--height=16",
        "--width=16",
        "--learning_rate=1e-3",
        "--hflip=false",
        "--stride_max=1",
        "--crop_scale_min=1.0",
        "--validation_every=40",
        "--checkpointing_steps=40",
        "--use_ema=false",
    )
    losses = scalars(run)["train/reconstruction_loss"]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:3]) / 3, losses


def test_yaml_accumulation_conflict_is_an_error(tmp_path, demo_clips):
    args = [
        sys.executable,
        *TRAIN,
        "--config",
        TEST_CONFIG,
        f"--output_dir={tmp_path}",
        f"--data_root={demo_clips['root']}",
        f"--annotation_file={demo_clips['train']}",
        f"--val_annotation_file={demo_clips['val']}",
    ]
    result = subprocess.run(
        args,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
        env={**os.environ, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "8"},
    )
    assert result.returncode == 2 and "remove it from the accelerate YAML" in result.stderr


def test_missing_reference_vae_is_an_error_not_a_fallback(tmp_path, demo_clips):
    (tmp_path / "empty").mkdir()
    args = [
        sys.executable,
        *TRAIN,
        "--config",
        TEST_CONFIG,
        f"--output_dir={tmp_path}",
        f"--data_root={demo_clips['root']}",
        f"--annotation_file={demo_clips['train']}",
        f"--val_annotation_file={demo_clips['val']}",
        f"--ref_vae_path={tmp_path / 'empty'}",
    ]
    result = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 2 and "is not a diffusers model folder" in result.stderr


def test_lpips_that_would_train_nothing_stops_the_start_naming_the_keys(tmp_path, demo_clips, tiny_cogvideox_vae):
    """A reference VAE without the reconstruction loss leaves no own decoded frames for LPIPS:
    the start stops with the keys to change (a UserError: exit 2), before a run folder exists."""
    with pytest.raises(UserError, match="set reconstruction_loss_weight > 0 or lpips_loss_weight=0"):
        train_here(
            tmp_path / "out",
            demo_clips,
            f"--ref_vae_path={tiny_cogvideox_vae}",
            "--reconstruction_loss_weight=0",
            "--lpips_loss_weight=0.1",
        )
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_spent_time_budget_ends_the_run_as_its_last_step_would(tmp_path, demo_clips):
    """max_train_time counts the start-up: a budget shorter than it ends the run after its
    first step with what the last step brings (validation, best model, checkpoint, export)."""
    run = train_here(tmp_path, demo_clips, "--max_train_time=0.01s", "--max_train_steps=50", "--run_name=run")
    assert_exported(run, "taehv")
    progress = json.loads((run / "checkpoints" / "checkpoint-1" / "trainer_state.json").read_text())["progress"]
    assert progress["step"] == 1 and progress["train_seconds"] > 0.01
    assert (run / "best_model").is_dir()
    assert "training ends at step 1: the time budget max_train_time=0.01s is spent" in (run / "train.log").read_text()


def test_unusable_validation_clips_stop_the_start_naming_their_file(tmp_path, demo_clips):
    """Validation clips are probed at start-up as the training clips are: an annotation whose
    clips do not exist stops the run before its first step, with a one-line error (a
    UserError) naming that file, instead of at the first validation."""
    missing = tmp_path / "val_missing.json"
    entries = [{"path": f"gone_{i}.mp4", "frames": 12} for i in range(2)]
    missing.write_text(json.dumps({"total": len(entries), "list": entries}))
    with pytest.raises(UserError) as error:
        train_here(tmp_path / "out", {**demo_clips, "val": missing}, "--run_name=run")
    assert str(error.value).startswith(
        f"2 of 2 probed clips are unusable (100% > max_failure_fraction=5%) in {missing}; reasons: {{'missing': 2}}"
    )
    assert not (tmp_path / "out" / "run" / "checkpoints").exists()  # not a step trained


def test_too_few_clips_for_one_full_batch_stop_the_start_in_one_line(tmp_path, demo_clips):
    """Fewer training clips than a full batch for every process would make every epoch empty
    (the last incomplete batch is dropped): the start stops with one line saying what to
    change, instead of waiting batch_timeout for a batch that never comes."""
    with pytest.raises(UserError) as error:
        train_here(tmp_path / "out", demo_clips, "--run_name=run", "--train_batch_size=6")
    assert str(error.value) == (
        "5 training clips make 0 full batches of train_batch_size=6, and the training process needs one per step. "
        "Add clips (at least 6), or lower train_batch_size or the number of processes"
    )
    assert not (tmp_path / "out" / "run" / "checkpoints").exists()


def test_resume_of_missing_checkpoint_is_an_error(tmp_path, demo_clips):
    args = [
        sys.executable,
        *TRAIN,
        "--config",
        TEST_CONFIG,
        f"--output_dir={tmp_path}",
        f"--data_root={demo_clips['root']}",
        f"--annotation_file={demo_clips['train']}",
        f"--val_annotation_file={demo_clips['val']}",
        "--resume",
        str(tmp_path / "run" / "checkpoints" / "checkpoint-9"),
    ]
    result = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_a_user_error_is_one_line_and_debug_keeps_the_traceback(tmp_path, demo_clips):
    args = [
        sys.executable,
        *TRAIN,
        "--config",
        TEST_CONFIG,
        f"--output_dir={tmp_path}",
        f"--data_root={demo_clips['root']}",
        f"--annotation_file={demo_clips['train']}",
        f"--val_annotation_file={demo_clips['val']}",
        "--height=0",
    ]
    result = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: invalid config: height=0 must be in [1, 16384]"
    ]
    debug = subprocess.run([*args, "--debug"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "UserError" in debug.stderr
    assert not any(tmp_path.iterdir())  # no run folder for a configuration error


@pytest.mark.parametrize(
    "variant, size, frames",
    [("taeh3", 16, 5), ("taeltx2_3", 32, 9), ("taeltx2_3_wide", 32, 9), ("taew2_2_super", 16, 5)],
)
def test_every_new_variant_trains_as_a_plain_autoencoder(tmp_path, demo_clips, variant, size, frames):
    """Two steps of each newer variant at its smallest valid size (8 * patch) and an exact
    frame count; the export loads into our model by its metadata, and by its published
    file name for the .pth."""
    run = train_here(
        tmp_path,
        demo_clips,
        f"--variant={variant}",
        f"--height={size}",
        f"--width={size}",
        f"--n_frames={frames}",
        "--max_train_steps=2",
        "--num_validation_samples=1",
        "--use_ema=false",
    )
    assert "val/psnr" in scalars(run)
    assert TAEHV(run / "final_model.safetensors").variant == variant
    published_name = tmp_path / f"{variant}.pth"
    (run / "final_model.pth").rename(published_name)
    assert TAEHV(published_name).variant == variant


def test_the_export_bundle_of_a_run(tmp_path, demo_clips, tiny_cogvideox_vae):
    """A run writes export/ at its end; `python -m taehv_train.training.export` writes the same from a
    run folder (with an fp16 copy). Every weight file loads strictly into our model without
    naming the variant and into a freshly built published-format model; the model card says
    what the model is, what it was trained on and how it validated."""
    run = train_here(
        tmp_path / "out",
        demo_clips,
        f"--ref_vae_path={tiny_cogvideox_vae}",
        "--ref_vae_dtype=fp32",
        "--max_train_steps=2",
    )
    bundle = run / "export"
    assert sorted(p.name for p in bundle.iterdir()) == ["README.md", "taecvx.pth", "taecvx.safetensors"]
    result = subprocess.run(
        [sys.executable, "-m", "taehv_train.training.export", str(run), "--out", str(tmp_path / "cli"), "--fp16"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == [
        "README.md",
        "taecvx.pth",
        "taecvx.safetensors",
        "taecvx_fp16.safetensors",
    ]
    for path in [*bundle.glob("taecvx*"), *(tmp_path / "cli").glob("taecvx*")]:
        ours = TAEHV(path)  # strict, variant from the file's name or metadata
        assert ours.variant == "taecvx"
        published = TAEHV(variant="taecvx")
        state = torch.load(path, weights_only=True) if path.suffix == ".pth" else load_file(str(path))
        published.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    card = (bundle / "README.md").read_text()
    assert "# taecvx (TAE)" in card and "CogVideoX" in card and "Frame rule: T -> ceil(T/4)" in card
    assert (
        "## Validation" in card and "val/psnr" in card and "taehv_train.py" in card and "Training: 2 of 2 steps" in card
    )
    assert "python -m taehv_train.training.export" in (tmp_path / "cli" / "README.md").read_text()
    # a checkpoint whose weights were damaged after saving: its manifest refuses it to both tools
    checkpoint = run / "checkpoints" / "checkpoint-2"
    data = bytearray((checkpoint / "weights.safetensors").read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = bytes(4096)
    (checkpoint / "weights.safetensors").write_bytes(bytes(data))
    for command in (
        [sys.executable, "-m", "taehv_train.training.export", str(checkpoint), "--out", str(tmp_path / "damaged")],
        [sys.executable, "inference.py", "--model_path", str(checkpoint), "--config", TEST_CONFIG],
    ):
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert "checkpoint-2 is damaged (weights.safetensors checksum)" in result.stderr
        assert f"{checkpoint / 'weights.safetensors'} cannot be trusted" in result.stderr


def test_the_progressive_recipe_chains_stage_two_from_stage_ones_export(tmp_path, demo_clips, tiny_cogvideox_vae):
    """Stage 1 (whole model, half size) then stage 2 (decoder only, full size) from stage 1's
    export, as the presets say, at tiny sizes: stage 2, launched through the launch script,
    keeps stage 1's encoder exactly. Stage 1 only makes the export stage 2 starts from, so
    it runs in this process."""
    torch.manual_seed(0)
    published = save_weights(TAEHV(variant="taecvx"), tmp_path / "taecvx.pth")
    tiny = [
        f"--ref_vae_path={tiny_cogvideox_vae}",
        "--ref_vae_dtype=fp32",
        "--mixed_precision=no",
        "--n_frames=9",
        "--max_train_steps=2",
        "--lr_warmup_steps=0",
        "--num_validation_samples=1",
        "--validation_every=2",
        "--checkpointing_steps=2",
        "--dataloader_num_workers=0",
    ]
    stage1 = train_here(
        tmp_path,
        demo_clips,
        *tiny,
        f"--pretrained_model_path={published}",
        "--height=16",
        "--width=16",
        config=str(preset_file("progressive_stage1")),
    )
    export = tmp_path / "progressive_stage1" / "export" / "taecvx.pth"
    assert stage1 == export.parents[1]
    stage2 = subprocess.run(
        [
            "bash",
            str(REPO_ROOT / "train_taehv_h100.sh"),
            "1",
            "progressive_stage2",
            f"--output_dir={tmp_path}",
            f"--data_root={demo_clips['root']}",
            f"--annotation_file={demo_clips['train']}",
            f"--val_annotation_file={demo_clips['val']}",
            *tiny,
            f"--pretrained_model_path={export}",
            "--height=32",
            "--width=32",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert stage2.returncode == 0, stage2.stderr[-3000:]
    before, after = (
        torch.load(export, weights_only=True),
        load_file(str(tmp_path / "progressive_stage2" / "final_model.safetensors")),
    )
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("encoder."))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("decoder."))
