#!/usr/bin/env python3
"""Every pending GPU figure of docs/benchmarks.md in one command, within 8 minutes on one
H100/H200, compilation included; prints a Markdown table (device and date on top) and
writes it with the JSON of everything measured.

    make gpu-check                                  # = python -m bench.gpu_check: run it first on a new GPU machine
    python -m bench.gpu_check --videos_dir DIR --out output/gpu_check.json   # your clips
    make gpu-check ARGS=--tiny                      # on a CPU in seconds per row: the command's own test

The figures ("Pending: the step that never waits"):

- ``e2e_plain`` / ``e2e_cached``: the 1gpu_h100 preset trained by the command users type,
  ``./train_taehv_h100.sh 1 1gpu_h100``, over the same engine fed batches already on the
  device (bench/lib/on_device_step.py, DeepSpeed ZeRO-2 bf16 started as training starts),
  plain (``--ref_vae_path=``) and with cached reference latents; target >= 0.90. The rows
  are bench/lib/gpu_training.py's, as ``python -m bench.bench_gpu --no-model`` runs them, here
  shorter: 20 s per on-device row, the launch script's ``--max_train_time`` fitted to the
  time left (at most 120 s, start-up and compilation included), its figures from its
  TensorBoard scalars after its first 20 steps. The cache is built with a tiny random-weight
  CogVideoX VAE of CogVideoX-2b's latent shape (the cached step never runs the VAE).
- ``plain_step``: the plain launch-script row's clips/s; target >= 2x the 18.2 clips/s
  measured on one H200 on 2026-11-26 before the step stopped waiting (the same command at
  the earlier commit, side by side, is the other way to take it; not run here).
- ``train_speed``: ``python -m bench.bench_train_speed --device cuda --cases 2x17x480x720
  --dtypes bf16``, the training forward and backward against the published model;
  target >= 1.0x.
- ``mfu_logged`` / ``gpu_idle_logged``: ``train/mfu`` and ``train/gpu_idle`` in the plain
  run's TensorBoard scalars and in its log line, with their values.
- ``zero2_vs_ddp``: ``python -m bench.bench_scaling --processes 2 --strategies ddp zero2``;
  needs two GPUs: skipped, with that reason, on one; on more it runs after the 8 minutes,
  bounded by ``--scaling_timeout``.

Every part runs in its own processes with its own time bound, fitted to what is left of
``--budget`` (480 s) so that the parts after it keep their minimum; a part that fails or
runs out of time is recorded with an ``error`` (or ``not run``) and the rest still run.
Clips: ``--videos_dir`` (a missing or empty folder is a one-line error, exit status 2,
before anything runs), by default procedural driving clips rendered by
training/demo_data.py, either re-encoded to 720x480 H.264 (bench/lib/reencoded_clips.py).
``--out`` (default output/gpu_check.json) gets the JSON and, next to it, the ``.md``
table. Exit status 1 when a figure could not be taken (error), else 0; a missed target is
a result, not a failure. ``--tiny``: on the CPU whatever the machine, the smallest sizes
(two 30-frame clips at 96x64, 9 frames of 8x8, a few steps, the train-speed case
1x5x16x16 in fp32): the command's test, its numbers say nothing about speed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.metadata
import json
import multiprocessing
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.lib.gpu_measure import log
from bench.lib.gpu_training import (
    PRESET_NAME,
    NotRun,
    Plan,
    RowFailed,
    VideosError,
    check_videos_dir,
    child_env,
    failure,
    feed_rows,
    prepare_clips,
    run_bounded,
    user_error,
)
from bench.lib.harness import REPO_ROOT, command_line, utc_now
from taehv_train.base.flags import ArgumentParser
from taehv_train.common.video.writer import write_video

BUDGET_S = 480.0  # 8 minutes on one GPU, compilation included
BEFORE_CLIPS_PER_S = 18.2  # the plain step through the launch script, one H200, 2026-11-26 (docs/benchmarks.md)
TARGETS = {"e2e": 0.90, "plain_step": 2 * BEFORE_CLIPS_PER_S, "train_speed": 1.0}
TRAIN_SPEED_CASE = {"gpu": ("2x17x480x720", "bf16"), "tiny": ("1x5x16x16", "fp32")}
SCALING_COMMAND = ["-m", "bench.bench_scaling", "--processes", "2", "--strategies", "ddp", "zero2"]
# the parts in the order they run: (bound wanted, minimum) seconds on a GPU; the on-device
# row of the plain feed compiles cold, the others find inductor's cache warm
SCHEDULE = {
    "plain.on_device": (170.0, 60.0),
    "plain.launch_script": (140.0, 90.0),
    "train_speed": (45.0, 25.0),
    "cached.cache": (45.0, 20.0),
    "cached.on_device": (80.0, 40.0),
    "cached.launch_script": (140.0, 90.0),
}
TINY_SCHEDULE = dict.fromkeys(SCHEDULE, (240.0, 10.0))


class Budget:
    """What is left of the run's seconds, handed out part by part: a part gets the bound
    it wants, less what the parts after it need at least; when that is below its own
    minimum it does not run (``NotRun``)."""

    def __init__(self, seconds: float, schedule: dict[str, tuple[float, float]], clock=time.monotonic):
        self.seconds, self.schedule, self.clock = seconds, schedule, clock
        self.started = clock()
        self.done: set[str] = set()

    def left(self) -> float:
        return self.seconds - (self.clock() - self.started)

    def bound(self, part: str) -> float:
        wanted, minimum = self.schedule[part]
        self.done.add(part)
        later = list(self.schedule)[list(self.schedule).index(part) + 1 :]
        reserve = sum(self.schedule[name][1] for name in later if name not in self.done)
        bound = min(wanted, self.left() - reserve)
        if bound < minimum:
            raise NotRun(
                f"not run: {self.left():.0f} s of the {self.seconds:.0f} s budget were left, "
                f"{reserve:.0f} s of them kept for the parts after it"
            )
        return bound


def gpu_plan(videos_dir: Path) -> Plan:
    """The end-to-end rows on the GPU, shortened to fit the budget."""
    return Plan(
        videos_dir,
        "cuda",
        on_device_seconds=20.0,
        run_time_s=120.0,
        launch_overhead_s=50.0,
        cache_vae="tiny",
    )


def render_clip_file(path: Path, index: int, frames: int, height: int, width: int) -> None:
    from taehv_train.training.demo_data import render_clip

    write_video(path, render_clip(np.random.default_rng([0, index]), frames, height, width), 24.0)


def render_clips(folder: Path, tiny: bool) -> Path:
    """Procedural driving clips (training/demo_data.py's scenes), when no clips are given,
    one process per clip: eight of 96 frames at 240x360 (re-encoded to 720x480 next: their
    rendering at full size would take minutes), or two of 30 at 64x96 (``--tiny``)."""
    clips, frames, height, width = (2, 30, 64, 96) if tiny else (8, 96, 240, 360)
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    context = multiprocessing.get_context("fork")  # no CUDA in this process yet; the workers only draw
    with concurrent.futures.ProcessPoolExecutor(min(clips, os.cpu_count() or 1), mp_context=context) as pool:
        jobs = [
            pool.submit(render_clip_file, folder / f"clip_{i:02d}.mp4", i, frames, height, width) for i in range(clips)
        ]
        for job in jobs:
            job.result()
    log(f"gpu-check: rendered {clips} procedural clips of {frames} frames in {time.perf_counter() - started:.1f} s")
    return folder


def train_speed(tiny: bool, device: str, folder: Path, timeout: float, published: Path | None) -> dict:
    """bench/bench_train_speed.py on its one case; its row, with the command."""
    case, dtype = TRAIN_SPEED_CASE["tiny" if tiny else "gpu"]
    out = folder / "train_speed.json"
    command = [
        sys.executable,
        "-m",
        "bench.bench_train_speed",
        "--device",
        device,
        "--cases",
        case,
        "--dtypes",
        dtype,
        *(["--warmup", "1", "--repeats", "1", "--threads", "1"] if tiny else ["--warmup", "2", "--repeats", "5"]),
        *(["--published", str(published)] if published else []),
        "--out",
        str(out),
    ]
    finished = run_bounded(command, timeout, folder / "train_speed.log", child_env())
    row = {"command": shlex.join(["python", *command[1:]]), "wall_s": round(finished.seconds, 1)}
    if finished.status != 0 or not out.is_file():
        raise RowFailed(row, failure(finished, timeout, "bench_train_speed"))
    return row | json.loads(out.read_text())["rows"][0]


def scaling(folder: Path, timeout: float) -> dict:
    """bench/bench_scaling.py, ZeRO-2 against DDP on two GPUs; its runs, with the command."""
    command = [sys.executable, *SCALING_COMMAND]
    stdout = folder / "scaling.json"
    finished = run_bounded(command, timeout, folder / "scaling.log", child_env(), stdout_file=stdout)
    row = {"command": "python " + " ".join(SCALING_COMMAND), "wall_s": round(finished.seconds, 1)}
    if finished.status != 0:
        raise RowFailed(row, failure(finished, timeout, "bench_scaling"))
    text = stdout.read_text()
    return row | {"runs": json.loads(text[text.index("{") :])["runs"]}


# -- the figures ----------------------------------------------------------------------------


@dataclass
class Figure:
    id: str
    figure: str
    target: str
    status: str  # pass, below target, measured (--tiny: no target), logged, missing, skipped, error, not run
    value: float | None = None
    shown: str = ""  # the value as the table shows it
    reason: str = ""
    source: str = ""  # the command the figure comes from


def judged(value: float, target: float, tiny: bool) -> str:
    if tiny:
        return "measured"
    return "pass" if value >= target else "below target"


def missing_status(row: dict | None) -> tuple[str, str]:
    """(status, reason) of a figure whose row failed or was not run."""
    if row is None:
        return "error", "the part did not run"
    error = row.get("error", "")
    if error.startswith("not run"):
        return "not run", error
    return "error", error.splitlines()[0][:300] if error else "no value"


def e2e_figure(feed: str, rows: list[dict], tiny: bool) -> Figure:
    by_setting = {row["setting"]: row for row in rows if row["feed"] == feed}
    launched, on_device = by_setting.get("launch_script"), by_setting.get("on_device")
    figure = Figure(
        f"e2e_{feed}",
        f"end to end, {feed}: the launch script's clips/s over the same engine fed on-device batches",
        f">= {TARGETS['e2e']:.2f}",
        "error",
        source=(launched or {}).get("command", ""),
    )
    if launched and "ratio_to_on_device" in launched:
        value = launched["ratio_to_on_device"]
        figure.value, figure.status = value, judged(value, TARGETS["e2e"], tiny)
        figure.shown = f"{value:.3f} ({launched['clips_per_s']:.2f} / {on_device['clips_per_s']:.2f} clips/s)"
    else:
        failed = next((row for row in (on_device, launched) if row is None or "error" in row), None)
        figure.status, figure.reason = missing_status(failed)
    return figure


def plain_step_figure(rows: list[dict], tiny: bool) -> Figure:
    launched = next((row for row in rows if row["feed"] == "plain" and row["setting"] == "launch_script"), None)
    figure = Figure(
        "plain_step",
        f"the {PRESET_NAME} preset's plain step through the launch script (clips/s)",
        f">= {TARGETS['plain_step']:.1f} (2x the {BEFORE_CLIPS_PER_S} of 2026-11-26, one H200)",
        "error",
        source=(launched or {}).get("command", ""),
    )
    if launched and launched.get("clips_per_s"):
        value = launched["clips_per_s"]
        figure.value, figure.status = value, judged(value, TARGETS["plain_step"], tiny)
        figure.shown = f"{value:.2f} clips/s ({value / BEFORE_CLIPS_PER_S:.2f}x)"
    else:
        figure.status, figure.reason = missing_status(launched)
    return figure


def train_speed_figure(row: dict | None, tiny: bool) -> Figure:
    case, dtype = TRAIN_SPEED_CASE["tiny" if tiny else "gpu"]
    figure = Figure(
        "train_speed",
        f"training forward + backward against the published model, {case} {dtype}",
        f">= {TARGETS['train_speed']:.1f}x",
        "error",
        source=(row or {}).get("command", ""),
    )
    if row and "ratio" in row:
        figure.value, figure.status = row["ratio"], judged(row["ratio"], TARGETS["train_speed"], tiny)
        figure.shown = f"{row['ratio']:.2f}x ({row['ours_s']:.4f} s / {row['published_s']:.4f} s)"
    else:
        figure.status, figure.reason = missing_status(row)
    return figure


def logged_figure(tag: str, label: str, rows: list[dict], device: str) -> Figure:
    """Whether the plain run logged ``tag`` to TensorBoard and its log line names ``label``."""
    launched = next((row for row in rows if row["feed"] == "plain" and row["setting"] == "launch_script"), None)
    name = tag.split("/")[1]
    figure = Figure(
        f"{name}_logged",
        f'`{tag}` in TensorBoard and "{label}" in the log line',
        "logged",
        "error",
        source=(launched or {}).get("command", ""),
    )
    if device != "cuda":
        figure.status = "skipped"
        figure.reason = (
            "logged on CUDA only" if name == "gpu_idle" else "logged for a GPU of known peak only (none on a CPU)"
        )
        return figure
    if launched is None or "tags" not in launched:
        figure.status, figure.reason = missing_status(launched)
        return figure
    in_tensorboard = tag in launched["tags"]
    in_line = launched.get(f"log_line_has_{name}", False)
    figure.value = launched.get(name)
    figure.status = "logged" if in_tensorboard and in_line else "missing"
    where = f"TensorBoard {'yes' if in_tensorboard else 'no'}, log line {'yes' if in_line else 'no'}"
    figure.shown = (f"{figure.value:.1%}; " if figure.value is not None else "") + where
    if figure.status == "missing" and name == "mfu":
        figure.reason = "train/mfu needs a GPU of known peak (training/loop/feed.py, BF16_PEAK)"
    return figure


def scaling_figure(row: dict | None, gpus: int) -> Figure:
    figure = Figure(
        "zero2_vs_ddp",
        "ZeRO-2 against DDP on NCCL, 2 processes",
        "DDP only if it gives the same results faster",
        "skipped",
        source="python " + " ".join(SCALING_COMMAND),
    )
    if gpus < 2:
        figure.reason = f"needs 2+ GPUs ({gpus} here): run `python {' '.join(SCALING_COMMAND)}` on a machine with them"
        return figure
    if row is None or "runs" not in row:
        figure.status, figure.reason = missing_status(row)
        return figure
    speed = {run["strategy"]: run["samples_per_s"] for run in row["runs"]}
    figure.status = "measured"
    figure.value = round(speed["ddp"] / speed["zero2"], 3) if speed.get("zero2") else None
    figure.shown = ", ".join(f"{k} {v:.2f} samples/s" for k, v in speed.items())
    return figure


# -- the report -------------------------------------------------------------------------------


def commit() -> str | None:
    """The checkout's commit, with "+changes" when the working tree differs from it."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=REPO_ROOT
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+changes" if dirty else "")


def versions() -> dict:
    """torch, CUDA and DeepSpeed (read from its metadata: importing it prints to stdout)."""
    try:
        deepspeed = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        deepspeed = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "deepspeed": deepspeed}


def share(value: float | None) -> str:
    return "" if value is None else f"{value:.1%}"


def markdown(report: dict) -> str:
    """The figures table, and the end-to-end rows and the train-speed row it comes from."""
    lines = [
        f"**{report['device']}**, {report['date']}, commit {report['commit'] or 'unknown'}, torch "
        f"{report['versions']['torch']}, CUDA {report['versions']['cuda']}, DeepSpeed "
        f"{report['versions']['deepspeed']}; `{report['command']}`, {report['total_s']:.0f} s"
        + (" (`--tiny`: on the CPU, says nothing about speed)" if report["tiny"] else ""),
        "",
        "| figure | target | measured | status |",
        "|---|---|---|---|",
    ]
    for fig in report["figures"]:
        status = fig["status"] + (f": {fig['reason']}" if fig["reason"] else "")
        lines.append(f"| {fig['figure']} | {fig['target']} | {fig['shown']} | {status.replace('|', '/')[:300]} |")
    lines += [
        "",
        "| feed | row | clips/s | frames/s | data wait | GPU idle | MFU | GPU GB | seconds measured |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["end_to_end"]:
        if "error" in row:
            error = row["error"].splitlines()[0][:120].replace("|", "/")
            lines.append(f"| {row['feed']} | {row['setting']} | {error} | | | | | | |")
            continue
        memory = "" if row.get("gpu_memory_gb") is None else f"{row['gpu_memory_gb']:.1f}"
        lines.append(
            f"| {row['feed']} | {row['setting']} | {row['clips_per_s']:.2f} | {row['frames_per_s']:.1f} | "
            f"{share(row['data_wait'])} | {share(row['gpu_idle'])} | {share(row['mfu'])} | {memory} | "
            f"{row['seconds']:.1f} |"
        )
    lines.append("")
    lines.append("Commands:")
    lines.append("")
    for row in report["end_to_end"]:
        if "command" in row:
            lines.append(f"- {row['feed']} {row['setting']}: `{row['command']}`")
    if report["train_speed"] and "command" in report["train_speed"]:
        lines.append(f"- train speed: `{report['train_speed']['command']}`")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="on the CPU at the smallest sizes (the command's test)")
    parser.add_argument(
        "--videos_dir", type=Path, help="clips to re-encode to 720x480 (default: procedural clips rendered here)"
    )
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "output" / "gpu_check.json", help="the JSON; the .md next to it"
    )
    parser.add_argument(
        "--budget", type=float, help=f"seconds for the one-GPU parts (default {BUDGET_S:.0f}; --tiny: 900)"
    )
    parser.add_argument(
        "--scaling_timeout", type=float, default=300.0, help="seconds for ZeRO-2 against DDP on 2+ GPUs (default 300)"
    )
    parser.add_argument("--published", type=Path, help="the published taehv.py for the train-speed figure")
    parser.add_argument("--work_dir", type=Path, help="keep the clips, runs and logs here (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.budget is None:
        args.budget = 900.0 if args.tiny else BUDGET_S
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.videos_dir is not None:
        try:
            check_videos_dir(args.videos_dir)
        except VideosError as err:
            user_error(str(err))
    if not args.tiny and not torch.cuda.is_available():
        user_error("no CUDA GPU here: make gpu-check measures a GPU machine (ARGS=--tiny runs its CPU test)")
    started = time.perf_counter()
    device = "cpu" if args.tiny else "cuda"
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    budget = Budget(args.budget, TINY_SCHEDULE if args.tiny else SCHEDULE)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        videos = args.videos_dir or render_clips(work / "rendered", args.tiny)
        plan = Plan.tiny_plan(videos) if args.tiny else gpu_plan(videos)
        plan.device = device
        clips = prepare_clips(plan, work)
        rows = feed_rows(plan, clips, "plain", work / "plain", lambda part: budget.bound(f"plain.{part}"))
        speed: dict | None
        try:
            speed = train_speed(args.tiny, device, work, budget.bound("train_speed"), args.published)
        except Exception as err:  # recorded; the rest still runs
            speed = failed_part(err)
            log(f"FAILED train speed: {speed['error'][:600]}")
        rows += feed_rows(plan, clips, "cached", work / "cached", lambda part: budget.bound(f"cached.{part}"))
        one_gpu_s = time.perf_counter() - started
        scaled = None
        if gpus >= 2:
            try:
                scaled = scaling(work, args.scaling_timeout)
            except Exception as err:  # recorded
                scaled = failed_part(err)
    figures = [
        e2e_figure("plain", rows, args.tiny),
        e2e_figure("cached", rows, args.tiny),
        plain_step_figure(rows, args.tiny),
        train_speed_figure(speed, args.tiny),
        logged_figure("train/mfu", "MFU", rows, device),
        logged_figure("train/gpu_idle", "GPU idle", rows, device),
        scaling_figure(scaled, gpus),
    ]
    report = {
        "benchmark": "gpu_check",
        "device": torch.cuda.get_device_name(0) if device == "cuda" else device_cpu(),
        "device_type": device,
        "gpus": gpus,
        "date": utc_now(),
        "commit": commit(),
        "versions": versions(),
        "command": command_line("bench.gpu_check"),
        "tiny": args.tiny,
        "budget_s": args.budget,
        "one_gpu_s": round(one_gpu_s, 1),
        "total_s": round(time.perf_counter() - started, 1),
        "figures": [vars(fig) for fig in figures],
        "end_to_end": rows,
        "train_speed": speed,
        "scaling": scaled,
        "settings": {
            "videos": str(args.videos_dir) if args.videos_dir else "procedural clips (training/demo_data.py)",
            "clips": {key: value for key, value in clips.items() if key not in ("data_root", "annotation_file")},
            "schedule_s": {part: {"wanted": w, "minimum": m} for part, (w, m) in budget.schedule.items()},
            "on_device_seconds": plan.on_device_seconds,
            "launch_script_run_time_s": None if plan.run_steps else plan.run_time_s,
            "launch_script_steps": plan.run_steps,
            "log_every": plan.log_every,
            "warmup_steps_left_out": plan.warmup_steps,
        },
    }
    text = markdown(report)
    report["markdown"] = text
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(text)
    print(text, flush=True)
    log(f"gpu-check: wrote {args.out} and {args.out.with_suffix('.md')}")
    if any(fig.status == "error" for fig in figures):
        sys.exit(1)


def failed_part(err: Exception) -> dict:
    """What a part that raised leaves: what it measured, and its error."""
    if isinstance(err, (RowFailed, NotRun)):
        return {**getattr(err, "row", {}), "error": str(err)[:4000]}
    return {"error": f"{type(err).__name__}: {err}"[:4000]}


def device_cpu() -> str:
    from bench.lib.gpu_measure import device_name

    return device_name(torch.device("cpu"))


if __name__ == "__main__":
    main()
