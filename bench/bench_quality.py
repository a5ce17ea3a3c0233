#!/usr/bin/env python3
"""Quality at equal budget: the project's recipe against a naive loop; prints one JSON
object and writes it with a PNG plot of the held-out curves.

    python -m bench.bench_quality                                  # ../shared/videos, 300 steps
    python -m bench.bench_quality --videos /data/clips --steps 1000 --out bench_quality_out
    python -m bench.bench_quality --arms recipe no_ema constant_lr full_crop stride_1 bias_0   # the ablation
    python -m bench.bench_quality --recipe_overrides --ema_decay=0.9    # the recipe with other settings
    python -m bench.bench_quality --arms recipe progressive             # two stages against one, equal steps

Both arms train the published TAEHV architecture (``--variant``) from the same seed on the
same clips, with the same steps, batch, size, frame count and learning rate, and are scored
on the same held-out clips (other files than the training clips) by the same validation
code (``training.loop.validation.validate``: PSNR/SSIM of aligned frames):

- ``recipe``: the product, run as a user runs it (``training/taehv_train.py`` with
  ``--config``, default the from-scratch preset ``taehv_config_scratch.py``, plus the
  shared settings and any ``--recipe_overrides``): its EMA weights, schedule, warm-up, clipping, crops, strides
  and decoder bias initialisation; validation uses the EMA weights it exports.
- ``naive``: plain AdamW on the reconstruction MSE, constant learning rate, no EMA, no
  clipping, default initialisation, on batches from the same loader.
- ablations (``ABLATIONS``): the recipe with one of its defaults turned off.
- ``progressive``: the two-stage recipe in the same steps (``run_progressive``): half of
  them on the whole model at half size, half on the decoder only at full size.

``seconds`` is wall time from the start of each arm (the recipe's includes starting its
process); both include their validations. Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bench.lib.harness import REPO_ROOT, command_line, print_json, shared_dir, threads_summary
from bench.lib.quality_plot import PALETTE, plot
from taehv_train.base.flags import ArgumentParser
from taehv_train.common.clips import frames_to_unit
from taehv_train.common.config import TrainConfig, load_config
from taehv_train.common.video.files import find_videos
from taehv_train.models.latent_spaces import OWN
from taehv_train.models.taehv import TAEHV
from taehv_train.training.annotate.annotation_files import write_annotation
from taehv_train.training.data.loading import build_datasets, build_train_loader
from taehv_train.training.ecosystem import export_stem
from taehv_train.training.loop.validation import validate

RECIPE_CONFIG = REPO_ROOT / "training" / "configs" / "taehv_config_scratch.py"


def split_clips(folder: Path, out: Path, every: int) -> tuple[Path, Path, list[str]]:
    """Train/held-out annotations: every ``every``-th file (sorted, from the third) is held
    out, so held-out clips are other files than the training clips."""
    files = find_videos(folder)
    held_out = files[every - 1 :: every]
    train = [f for f in files if f not in held_out]
    if not train or not held_out:
        raise SystemExit(f"error: {folder} needs at least {every} videos for a train/held-out split, has {len(files)}")
    paths = out / "annotations_train.json", out / "annotations_val.json"
    write_annotation(paths[0], [{"path": f} for f in train])
    write_annotation(paths[1], [{"path": f} for f in held_out])
    return *paths, held_out


def shared_settings(args: argparse.Namespace, folder: Path, train: Path, val: Path, n_val: int) -> list[str]:
    """The ``--key=value`` settings both arms share."""
    every = max(1, args.steps // args.points)
    return [
        f"--data_root={folder}",
        f"--annotation_file={train}",
        f"--val_annotation_file={val}",
        f"--variant={args.variant}",
        f"--n_frames={args.frames}",
        f"--height={args.size}",
        f"--width={args.size}",
        f"--train_batch_size={args.batch}",
        f"--learning_rate={args.lr}",
        f"--max_train_steps={args.steps}",
        f"--seed={args.seed}",
        f"--validation_every={every}",
        f"--num_validation_samples={n_val}",
        f"--log_every={every}",
        "--image_log_every=0",
        f"--checkpointing_steps={args.steps}",
        "--dataloader_num_workers=0",
        "--mixed_precision=no",
        "--pretrained_model_path=",
        "--ref_vae_path=",
    ]


# arm -> the recipe's settings it changes: each turns off one default of the recipe
ABLATIONS = {
    "no_ema": ["--use_ema=false"],  # score the raw weights
    "constant_lr": ["--lr_scheduler=constant", "--lr_warmup_steps=0"],  # no warm-up, no decay
    "full_crop": ["--crop_scale_min=1.0"],  # always the largest crop (no scale jitter)
    "stride_1": ["--stride_min=1", "--stride_max=1"],  # consecutive frames only
    "bias_0": ["--decoder_bias_init=0.0"],  # final decoder bias 0 instead of mid-grey
    "no_clipping": ["--max_grad_norm=0"],
}
ARMS = ("recipe", "naive", *ABLATIONS, "progressive")


def run_recipe(
    args: argparse.Namespace, settings: list[str], out: Path, arm: str = "recipe", extra: tuple[str, ...] = ()
) -> list[dict]:
    """The training script, as a user runs it (with ``arm``'s ablation and ``extra``
    settings); the curve from its validation history."""
    command = [
        sys.executable,
        "-m",
        "taehv_train.training.taehv_train",
        "--config",
        str(args.config),
        *settings,
        f"--output_dir={out}",
        f"--run_name={arm}",
        *args.recipe_overrides,
        *ABLATIONS.get(arm, []),
        *extra,
    ]
    start = time.time()
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    if result.returncode != 0:
        raise SystemExit(f"error: the {arm} run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    run = out / arm
    events = EventAccumulator(str(run / "logs"), size_guidance={"scalars": 0})
    events.Reload()
    wall = {e.step: e.wall_time - start for e in events.Scalars("val/psnr")}
    history = json.loads((run / "validation_history.json").read_text())
    return [
        {"step": h["step"], "psnr": h["val/psnr"], "ssim": h["val/ssim"], "seconds": round(wall[h["step"]], 1)}
        for h in history
    ]


def run_progressive(args: argparse.Namespace, settings: list[str], out: Path) -> list[dict]:
    """The progressive recipe at the same number of steps: the first half trains the whole
    model at half the size (validated at full size), the second half only the decoder at
    full size from the first half's export (``train_encoder=false``); one curve."""
    first = args.steps // 2
    half = [
        f"--height={args.size // 2}",
        f"--width={args.size // 2}",
        f"--val_height={args.size}",
        f"--val_width={args.size}",
    ]
    stage1 = run_recipe(
        args,
        settings,
        out,
        "progressive_stage1",
        (f"--max_train_steps={first}", f"--checkpointing_steps={first}", *half),
    )
    export = out / "progressive_stage1" / "export" / f"{export_stem(args.variant, OWN)}.pth"  # no reference VAE
    stage2 = run_recipe(
        args,
        settings,
        out,
        "progressive_stage2",
        (
            f"--max_train_steps={args.steps - first}",
            f"--checkpointing_steps={args.steps - first}",
            "--train_encoder=false",
            f"--pretrained_model_path={export}",
        ),
    )
    elapsed = stage1[-1]["seconds"]
    return stage1 + [{**p, "step": p["step"] + first, "seconds": round(p["seconds"] + elapsed, 1)} for p in stage2]


def run_naive(config: TrainConfig, every: int) -> list[dict]:
    """Plain AdamW on MSE(decode(encode(x)), x), constant LR, no EMA, no clipping."""
    start = time.time()
    accelerator = Accelerator(cpu=True)
    train_set, val_set = build_datasets(config)
    torch.manual_seed(config.seed)
    model = TAEHV(variant=config.variant)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate)
    loader = build_train_loader(train_set, config, accelerator.device, accelerator.num_processes)
    curve, step, epoch = [], 0, 0
    while step < config.max_train_steps:
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            frames = frames_to_unit(batch["frames"], accelerator.device)
            model.train()
            decoded = model(frames).decoded
            loss = torch.nn.functional.mse_loss(decoded, model.plan(frames.shape[1]).target(frames))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % every == 0 or step == config.max_train_steps:
                metrics = validate(accelerator, model, val_set, config, None, torch.float32)
                curve.append(
                    {
                        "step": step,
                        "psnr": metrics["val/psnr"],
                        "ssim": metrics["val/ssim"],
                        "seconds": round(time.time() - start, 1),
                    }
                )
            if step == config.max_train_steps:
                break
        epoch += 1
    return curve


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--videos", type=Path, default=shared_dir() / "videos", help="clip folder (default: ../shared/videos)"
    )
    parser.add_argument("--hold_out_every", type=int, default=3, help="every N-th file (sorted) is held out")
    parser.add_argument("--config", type=Path, default=RECIPE_CONFIG, help="the recipe's config file")
    parser.add_argument("--variant", default="taehv")
    parser.add_argument("--frames", type=int, default=13)
    parser.add_argument("--size", type=int, default=64, help="square crop size")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--points", type=int, default=12, help="validations along each curve")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for quality.json and quality.png (default: a temporary one)"
    )
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=ARMS,
        default=["recipe", "naive"],
        help="what to train: the recipe, the naive loop, and/or ablations of the recipe",
    )
    parser.add_argument(
        "--recipe_overrides",
        nargs=argparse.REMAINDER,
        default=[],
        help="--key=value settings for the recipe and its ablations, not the naive loop (everything after this flag)",
    )
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_quality_"))
    out.mkdir(parents=True, exist_ok=True)
    folder = args.videos.resolve()
    train, val, held_out = split_clips(folder, out, args.hold_out_every)
    settings = shared_settings(args, folder, train, val, len(held_out))
    with contextlib.redirect_stdout(sys.stderr):  # libraries' log lines stay out of the JSON
        run = {
            "naive": lambda: run_naive(load_config(args.config, settings), max(1, args.steps // args.points)),
            "progressive": lambda: run_progressive(args, settings, out),
        }
        curves = {
            arm: run[arm]() if arm in run else run_recipe(args, settings, out, arm) for arm in dict.fromkeys(args.arms)
        }
    result = {
        "machine": threads_summary(),
        "torch": torch.__version__,
        "command": command_line(),
        "videos": str(folder),
        "held_out": held_out,
        "variant": args.variant,
        "frames": args.frames,
        "size": args.size,
        "batch": args.batch,
        "lr": args.lr,
        "steps": args.steps,
        "seed": args.seed,
        "recipe_config": str(args.config),
        "recipe_overrides": args.recipe_overrides,
        "ablations": {arm: ABLATIONS[arm] for arm in curves if arm in ABLATIONS},
        "curves": curves,
        "final": {arm: {"psnr": curve[-1]["psnr"], "ssim": curve[-1]["ssim"]} for arm, curve in curves.items()},
    }
    (out / "quality.json").write_text(json.dumps(result, indent=1))
    plot(
        result["curves"],
        out / "quality.png",
        f"{args.variant}, {args.frames} frames at {args.size}x{args.size}, batch {args.batch}, lr {args.lr:g}, "
        f"{args.steps} steps; held out: {', '.join(held_out)}",
        "step",
        dict(zip(ARMS, PALETTE)),
    )
    print_json(result)


if __name__ == "__main__":
    main()
