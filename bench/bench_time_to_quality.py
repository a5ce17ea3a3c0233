#!/usr/bin/env python3
"""Time to quality: held-out quality after the same wall-clock budgets, our from-scratch
preset against a bare training loop on the published model, several seeds; prints JSON
and a Markdown table, and writes both with PNGs of quality against seconds.

    python -m bench.bench_time_to_quality                          # 8 minutes a run, 3 seeds, ../shared/videos
    python -m bench.bench_time_to_quality --budgets 4m 8m 16m      # quality against seconds over three budgets
    python -m bench.bench_time_to_quality --budgets 2m --seeds 1 --out /tmp/ttq
    python -m bench.bench_time_to_quality --held_out choose --arms ours --ours_overrides --ema_decay=0.95  # choosing

Clips (``split_clips``): every ``--hold_out_every``-th file (sorted) of ``--videos`` is
held out, alternately into the ``choose`` set (what settings are chosen on) and the
``report`` set (what the chosen recipe is reported on, which no choice has seen); the
others train both arms. ``--held_out`` says which set the runs validate and are scored on.
Arms, each budget of wall time from its start, one run after the other (run on a quiet
machine):

- ``ours``: ``./train_taehv_h100.sh 1 scratch --max_train_time=<budget>``, the command a
  user types, with the data paths, the seed, the run's folder and any
  ``--ours_overrides``; the budget alone is its length (start-up included), with its
  validations spread over it; its EMA weights (``final_model.safetensors``).
- ``bare``: the published ``taehv.py`` (``../shared/reference``) in a 30-line loop: MSE of
  ``decode(encode(x))`` against ``x``, AdamW (lr 3e-4, betas 0.9/0.95), final decoder
  bias 0.5, the training clips decoded once into memory (short side ``--size``),
  batches of ``--batch`` random ``--frames``-frame windows and ``--size`` squares; its
  clock starts before the clips are decoded and stops while it is scored.

Score (the final numbers): the held-out clips' first ``--frames`` frames, centre square
resized to ``--size``, through each arm's final weights in our ``TAEHV``: PSNR, SSIM and
sharpness (the share of high-frequency energy kept, ``common.metrics``), and a still of
each clip's middle frame, original and each arm's first seed at the longest budget
(``time_to_quality_stills.png``). ``time_to_quality.png``: each arm's mean score against
the budget's seconds. ``time_to_quality_curves.png``: each arm's held-out PSNR/SSIM during
training (first seed of each budget), from the same ``training.loop.validation.validate``
on the same held-out set as the preset validates it (its frame count and size, centred),
against seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np
import torch
from accelerate import Accelerator
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bench.lib.harness import (
    REPO_ROOT,
    command_line,
    cpu_name,
    load_published,
    print_json,
    published_file,
    shared_dir,
    threads_summary,
)
from bench.lib.published_model import published_loss
from bench.lib.quality_plot import PALETTE, plot
from taehv_train.base.flags import ArgumentParser
from taehv_train.common.clip_table import ClipTable
from taehv_train.common.clips import VideoClipDataset
from taehv_train.common.config import load_config
from taehv_train.common.metrics import video_psnr, video_sharpness, video_ssim
from taehv_train.common.video.files import find_videos
from taehv_train.common.video.resize import area_resize
from taehv_train.models.taehv import TAEHV
from taehv_train.models.weights import load_weights
from taehv_train.training.annotate.annotation_files import write_annotation
from taehv_train.training.data.loading import build_datasets
from taehv_train.training.loop.optimisation import parse_duration
from taehv_train.training.loop.validation import validate

PRESET = REPO_ROOT / "training" / "configs" / "taehv_config_scratch.py"
ARMS = ("ours", "bare")
HELD_OUT_SETS = ("choose", "report")


def split_clips(folder: Path, out: Path, every: int, held_out: str) -> tuple[Path, Path, dict[str, list[str]]]:
    """(training annotations, ``held_out`` annotations, every set's files): every
    ``every``-th file (sorted) is held out, alternately into ``choose`` and ``report``,
    so that the clips a recipe is reported on played no part in choosing it."""
    files = find_videos(folder)
    held = files[every - 1 :: every]
    sets = {"train": [f for f in files if f not in held], "choose": held[0::2], "report": held[1::2]}
    if not all(sets.values()):
        raise SystemExit(
            f"error: {folder} needs at least {2 * every} videos for training, choose and report sets, has {len(files)}"
        )
    paths = out / "annotations_train.json", out / f"annotations_{held_out}.json"
    write_annotation(paths[0], [{"path": f} for f in sets["train"]])
    write_annotation(paths[1], [{"path": f} for f in sets[held_out]])
    return *paths, sets


def centre_square(frame: np.ndarray, size: int) -> np.ndarray:
    h, w = frame.shape[:2]
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    return area_resize(frame[top : top + side, left : left + side], size, size)


def read_frames(path: str, count: int | None, short_side: int) -> np.ndarray:
    """Up to ``count`` (None: all) RGB frames from the start of ``path``, resized so that the
    short side is ``short_side``: (T, H, W, 3) uint8."""
    capture, frames = cv2.VideoCapture(path), []
    while count is None or len(frames) < count:
        ok, frame = capture.read()
        if not ok:
            break
        h, w = frame.shape[:2]
        scale = short_side / min(h, w)
        frames.append(cv2.cvtColor(area_resize(frame, round(w * scale), round(h * scale)), cv2.COLOR_BGR2RGB))
    capture.release()
    if not frames:
        raise SystemExit(f"error: no frames decode from {path}")
    return np.stack(frames)


def to_unit(frames: np.ndarray) -> torch.Tensor:
    """(..., T, H, W, 3) uint8 -> (..., T, 3, H, W) float in [0, 1]."""
    return torch.from_numpy(frames).movedim(-1, -3).float().div(255)


def score_set(paths: list[str], frames: int, size: int) -> torch.Tensor:
    """The held-out clips' first ``frames`` frames, centre square at ``size``: (N, T, 3, size, size)."""
    clips = []
    for path in paths:
        video = read_frames(path, frames, size)
        if len(video) < frames:
            raise SystemExit(f"error: {path} has {len(video)} frames, the score needs {frames}")
        clips.append(np.stack([centre_square(f, size) for f in video]))
    return to_unit(np.stack(clips))


@torch.no_grad()
def score(model: TAEHV, clips: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
    """The metrics of ``model`` on the scored clips, and its reconstructions of them."""
    model.eval()
    plan = model.plan(clips.shape[1])
    decoded, target = plan.aligned(model.decode_video(model.encode_video(clips)), clips)
    metrics = {
        "psnr": float(video_psnr(decoded, target).mean()),
        "ssim": float(video_ssim(decoded, target).mean()),
        "sharpness": float(video_sharpness(decoded, target).mean()),
    }
    return metrics, decoded


def stills(clips: torch.Tensor, decoded: dict[str, torch.Tensor], path: Path, zoom: int = 4) -> None:
    """One row per scored clip, its middle frame: the original, then each arm's reconstruction."""

    def picture(frame: torch.Tensor) -> np.ndarray:
        rgb = frame.clamp(0, 1).mul(255).round().byte().permute(1, 2, 0).numpy()
        return cv2.resize(rgb, None, fx=zoom, fy=zoom, interpolation=cv2.INTER_NEAREST)

    middle = clips.shape[1] // 2
    rows = [
        np.concatenate([picture(clips[i, middle]), *(picture(d[i, middle]) for d in decoded.values())], 1)
        for i in range(len(clips))
    ]
    grid = np.ascontiguousarray(np.concatenate(rows, 0)[:, :, ::-1])
    for k, label in enumerate(["original", *decoded]):
        cv2.putText(
            grid, label, (k * clips.shape[-1] * zoom + 4, 14), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (255, 255, 255), 1
        )
    if not cv2.imwrite(str(path), grid):
        raise OSError(f"cannot write {path}")


def run_ours(
    args: argparse.Namespace, budget: str, seed: int, data: list[str], out: Path
) -> tuple[TAEHV, list[dict], float]:
    """The preset through the launch script as a user types it; its final EMA weights, its
    validation curve and its wall seconds."""
    name = f"ours_{budget}_{seed}"
    command = [
        "./train_taehv_h100.sh",
        "1",
        "scratch",
        f"--max_train_time={budget}",
        *data,
        f"--seed={seed}",
        f"--output_dir={out}",
        f"--run_name={name}",
        *args.ours_overrides,
    ]
    start = time.time()
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    seconds = time.time() - start
    if result.returncode != 0:
        raise SystemExit(f"error: the preset's run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    run = out / name
    events = EventAccumulator(str(run / "logs"), size_guidance={"scalars": 0})
    events.Reload()
    wall = {e.step: e.wall_time - start for e in events.Scalars("val/psnr")}
    history = json.loads((run / "validation_history.json").read_text())
    curve = [
        {"step": h["step"], "psnr": h["val/psnr"], "ssim": h["val/ssim"], "seconds": round(wall[h["step"]], 1)}
        for h in history
    ]
    model = TAEHV(variant="taehv")
    load_weights(model, run / "final_model.safetensors")
    return model, curve, seconds


def run_bare(
    args: argparse.Namespace,
    budget: str,
    seed: int,
    train_paths: list[str],
    val_set: VideoClipDataset,
    val_config,
) -> tuple[TAEHV, list[dict], float]:
    """The published model in a bare loop; its weights, curve and seconds (its clock stops
    while it is scored)."""
    limit = parse_duration(budget)
    every = limit / args.points
    spent, since = 0.0, time.perf_counter()
    published_module = load_published(published_file("taehv"))
    clips = [read_frames(path, None, args.size) for path in train_paths]
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = published_module.TAEHV(checkpoint_path=None)
    with torch.no_grad():
        model.decoder[-1].bias.fill_(0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95))
    scored = TAEHV(variant="taehv")
    accelerator = Accelerator(cpu=True)
    curve, step, next_point = [], 0, every
    while True:
        spent += time.perf_counter() - since
        since = time.perf_counter()
        if spent >= next_point or spent >= limit:  # score off the clock
            scored.load_state_dict(model.state_dict())
            metrics = validate(accelerator, scored, val_set, val_config, None, torch.float32)
            curve.append(
                {"step": step, "psnr": metrics["val/psnr"], "ssim": metrics["val/ssim"], "seconds": round(spent, 1)}
            )
            next_point += every
            since = time.perf_counter()
            if spent >= limit:
                break
        batch = []
        for _ in range(args.batch):
            video = clips[rng.integers(len(clips))]
            start = rng.integers(len(video) - args.frames + 1)
            left = rng.integers(video.shape[2] - args.size + 1)
            batch.append(video[start : start + args.frames, :, left : left + args.size])
        model.train()
        loss = published_loss(published_module, model, to_unit(np.stack(batch)))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
    scored.load_state_dict(model.state_dict())
    return scored, curve, spent


def summary(finals: list[dict]) -> dict[str, dict[str, float]]:
    return {
        key: {
            "mean": statistics.fmean(f[key] for f in finals),
            "std": statistics.stdev(f[key] for f in finals) if len(finals) > 1 else 0.0,
        }
        for key in ("psnr", "ssim", "sharpness")
    }


def difference(ours: dict, bare: dict) -> dict[str, float]:
    """Ours minus bare, in the means of the final scores."""
    return {
        "psnr_db": ours["psnr"]["mean"] - bare["psnr"]["mean"],
        "ssim": ours["ssim"]["mean"] - bare["ssim"]["mean"],
        "sharpness": ours["sharpness"]["mean"] - bare["sharpness"]["mean"],
    }


def markdown(result: dict) -> str:
    """One row per arm and budget, then each budget's difference between the arms."""
    lines = [
        "| arm | budget | seeds | PSNR dB (mean ± sd) | SSIM | sharpness | steps | wall s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for budget in result["budgets"]:
        for arm in ARMS:
            s = result["summary"][arm][budget]
            runs = [r for r in result["runs"][arm] if r["budget"] == budget]
            steps = ", ".join(str(r["curve"][-1]["step"]) for r in runs)
            seconds = ", ".join(f"{r['seconds']:.0f}" for r in runs)
            lines.append(
                f"| {arm} | {budget} | {len(runs)} | {s['psnr']['mean']:.2f} ± {s['psnr']['std']:.2f} | "
                f"{s['ssim']['mean']:.3f} ± {s['ssim']['std']:.3f} | "
                f"{s['sharpness']['mean']:.3f} ± {s['sharpness']['std']:.3f} | {steps} | {seconds} |"
            )
    lines.append("")
    for budget, d in result["difference"].items():
        lines.append(
            f"{budget}: ours - bare: {d['psnr_db']:+.2f} dB PSNR, {d['ssim']:+.3f} SSIM, "
            f"{d['sharpness']:+.3f} sharpness"
        )
    return "\n".join(lines)


def plots(result: dict, out: Path) -> None:
    """Each arm's mean score against the budget's seconds; each arm's validation curve
    during training (first seed of each budget) against seconds."""
    runs, held_out = result["runs"], f"held out ({result['held_out_set']}): {', '.join(result['held_out'])}"
    means = result["summary"]
    scores = {
        arm: [
            {"seconds": parse_duration(b), "psnr": means[arm][b]["psnr"]["mean"], "ssim": means[arm][b]["ssim"]["mean"]}
            for b in result["budgets"]
        ]
        for arm in runs
    }
    title = f"final score against the budget, mean of seeds; {held_out}"
    plot(scores, out / "time_to_quality.png", title, "seconds", {arm: PALETTE[ARMS.index(arm)] for arm in scores})
    first = result["seeds"][0]
    curves = {f"{arm} {r['budget']}": r["curve"] for arm in runs for r in runs[arm] if r["seed"] == first}
    colours = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(curves)}
    title = f"validation during training against seconds, seed {first}; {held_out}"
    plot(curves, out / "time_to_quality_curves.png", title, "seconds", colours)


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--videos", type=Path, default=shared_dir() / "videos", help="clip folder (default: ../shared/videos)"
    )
    parser.add_argument("--hold_out_every", type=int, default=3, help="every N-th file (sorted) is held out")
    parser.add_argument(
        "--held_out",
        choices=HELD_OUT_SETS,
        default="report",
        help="the held-out set the runs are validated and scored on: choose (for choosing settings) or report",
    )
    parser.add_argument(
        "--budgets", nargs="+", default=["8m"], help="wall-clock budgets, a run each per seed and arm (8m, 90s, ...)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--frames", type=int, default=13, help="frames per clip: the bare loop's and the score's")
    parser.add_argument("--size", type=int, default=64, help="square size: the bare loop's and the score's")
    parser.add_argument("--batch", type=int, default=4, help="the bare loop's batch")
    parser.add_argument("--points", type=int, default=8, help="scores along the bare loop's curve")
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for the runs, JSON and plots (default: temporary)"
    )
    parser.add_argument(
        "--ours_overrides",
        nargs=argparse.REMAINDER,
        default=[],
        help="--key=value settings for the preset (everything after this flag)",
    )
    args = parser.parse_args()
    for budget in args.budgets:
        if parse_duration(budget) is None:
            raise SystemExit(f"error: --budgets {budget!r} is not a duration (e.g. 8m, 90s)")
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_time_to_quality_"))
    out.mkdir(parents=True, exist_ok=True)
    folder = args.videos.resolve()
    train, val, sets = split_clips(folder, out, args.hold_out_every, args.held_out)
    held_out = sets[args.held_out]
    data = [f"--data_root={folder}", f"--annotation_file={train}", f"--val_annotation_file={val}"]
    val_config = load_config(PRESET, data)
    _, val_set = build_datasets(val_config)  # the held-out set the preset's run validates on, as it validates it
    train_table = ClipTable.from_annotation(train, folder)
    train_paths = [train_table.path(i) for i in range(len(train_table))]
    clips = score_set([str(folder / name) for name in held_out], args.frames, args.size)
    runs: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    longest = max(args.budgets, key=parse_duration)
    first_seed: dict[str, torch.Tensor] = {}  # each arm's reconstructions, first seed at the longest budget
    with contextlib.redirect_stdout(sys.stderr):  # libraries' log lines stay out of the JSON
        for budget in args.budgets:
            for seed in args.seeds:
                for arm in args.arms:
                    if arm == "ours":
                        model, curve, seconds = run_ours(args, budget, seed, data, out)
                    else:
                        model, curve, seconds = run_bare(args, budget, seed, train_paths, val_set, val_config)
                    metrics, decoded = score(model, clips)
                    if budget == longest:
                        first_seed.setdefault(arm, decoded)
                    runs[arm].append(
                        {"budget": budget, "seed": seed, "seconds": round(seconds, 1), "final": metrics, "curve": curve}
                    )
                    print(json.dumps({"arm": arm, "budget": budget, "seed": seed, **metrics}), flush=True)
    result = {
        "machine": threads_summary(cpu_name()),
        "torch": torch.__version__,
        "command": command_line(),
        "videos": str(folder),
        "clip_sets": sets,
        "held_out_set": args.held_out,
        "held_out": held_out,
        "budgets": args.budgets,
        "seeds": args.seeds,
        "frames": args.frames,
        "size": args.size,
        "bare_batch": args.batch,
        "ours_overrides": args.ours_overrides,
        "runs": runs,
        "summary": {
            arm: {b: summary([r["final"] for r in runs[arm] if r["budget"] == b]) for b in args.budgets} for arm in runs
        },
    }
    if len(runs) == 2:
        result["difference"] = {
            budget: difference(result["summary"]["ours"][budget], result["summary"]["bare"][budget])
            for budget in args.budgets
        }
    (out / "time_to_quality.json").write_text(json.dumps(result, indent=1))
    plots(result, out)
    stills(clips, first_seed, out / "time_to_quality_stills.png")
    print_json(result)
    if len(runs) == 2:
        table = markdown(result)
        (out / "time_to_quality.md").write_text(table + "\n")
        print(table)


if __name__ == "__main__":
    main()
