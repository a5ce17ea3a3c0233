"""The end-to-end training rows of bench/bench_gpu.py and bench/gpu_check.py: the
1gpu_h100 preset trained by the command users type (``./train_taehv_h100.sh 1 1gpu_h100``,
its speed read back from what the run logs), against the same engine fed batches that are
already on the device (bench/lib/on_device_step.py, started as training starts), plain and
with cached reference latents. Every row runs in its own processes, bounded in time; the
process that calls these functions never touches the GPU for them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import psutil

from bench.lib.gpu_measure import log
from bench.lib.harness import REPO_ROOT
from bench.lib.reencoded_clips import DASH_CAMERA_GOP, reencode_clips
from taehv_train.base.errors import EXIT_USER_ERROR
from taehv_train.base.ports import free_port
from taehv_train.common.video.files import find_videos
from taehv_train.models.vae_registry import reference_vae_frames
from taehv_train.models.variants import get_variant
from taehv_train.training.annotate.annotation_files import write_annotation
from tools.make_reference_vae import COGVIDEOX_2B, TINY_COGVIDEOX, save_reference_vae

PRESET_NAME = "1gpu_h100"
PRESET = REPO_ROOT / "training" / "configs" / f"taehv_config_{PRESET_NAME}.py"
PRESET_VARIANT = "taecvx"  # the preset's (tests check the rows against it)
LAUNCH_SCRIPT = "./train_taehv_h100.sh"
ONE_GPU_YAML = "accelerate_configs/deepspeed_1gpu.yaml"
E2E_FEEDS = ("plain", "cached")  # reference latents: none, or from the latent cache
E2E_SETTINGS = ("on_device", "launch_script")
CACHE_VAES = {
    "cogvideox-2b": ("CogVideoX-2b architecture (tools/make_reference_vae.py)", COGVIDEOX_2B),
    "tiny": ("tiny CogVideoX (4 channels per block, CogVideoX-2b's latent shape)", TINY_COGVIDEOX),
}
LOG_TAIL = 3000  # characters of a failed process's output kept in its row
STEP_LINE = re.compile(r"training\.loop\.monitoring: step (\d+): (.*)$")


class VideosError(ValueError):
    """The clips folder is missing or holds no video (a one-line error, exit status 2)."""


def user_error(message: str) -> NoReturn:
    """A problem the user fixes: one line ``error: ...`` on stderr, exit status 2 (as training's)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USER_ERROR)


def check_videos_dir(videos_dir: Path | None, flag: str = "--videos_dir") -> None:
    """Refuse a missing or empty clips folder before anything runs."""
    if videos_dir is None:
        raise VideosError(f"{flag} DIR is required: a folder of video clips (they are re-encoded to 720x480 H.264)")
    if not videos_dir.is_dir():
        raise VideosError(f"{flag} {videos_dir}: no such folder")
    if not find_videos(videos_dir):
        raise VideosError(f"{flag} {videos_dir}: no video files in it")


@dataclass
class Plan:
    """What the end-to-end rows run: their sizes, lengths and time bounds."""

    videos_dir: Path
    device: str  # "cuda" or "cpu": how the on-device process is launched
    tiny: bool = False
    clips_per_epoch: int = 256  # annotation entries (the clips listed over and over)
    max_clips: int = 8  # the first clips of the folder (by name) that are re-encoded
    max_frames: int = 300  # of each
    workers: int | None = None  # None: the preset's dataloader_num_workers
    on_device_seconds: float = 60.0  # timed seconds of an on-device row
    warmup_windows: int = 3  # on-device windows before timing (the first compiles)
    run_time_s: float = 150.0  # the launch script's --max_train_time (start-up and compilation included)
    launch_overhead_s: float = 60.0  # the launch script's seconds outside that budget (checks, imports, export)
    run_steps: int | None = None  # instead of a time budget: --max_train_steps (--tiny)
    log_every: int = 10  # the run's log interval (the preset's 50 leaves few points in minutes)
    warmup_steps: int = 20  # the run's first steps, left out of its figures (start-up, compilation)
    cache_vae: str = "cogvideox-2b"  # the random-weight VAE the latent cache is built with
    compile_backend: str = "inductor"
    timeouts: dict[str, float] = field(
        default_factory=lambda: {"cache": 600.0, "on_device": 600.0, "launch_script": 600.0}
    )

    @classmethod
    def tiny_plan(cls, videos_dir: Path, device: str = "cpu") -> Plan:
        """Seconds per row on a CPU: two 30-frame clips at 96x64, the smallest training clip
        the preset allows, no mixed precision, one worker, a tiny VAE for the cache; the
        on-device row times its first window (nothing compiles on a CPU), the launch script
        runs 3 steps and its figures come from the last 2."""
        return cls(
            videos_dir,
            device,
            tiny=True,
            clips_per_epoch=32,
            max_clips=2,
            max_frames=30,
            workers=1,
            on_device_seconds=1.0,
            warmup_windows=0,
            run_steps=3,
            log_every=1,
            warmup_steps=1,
            cache_vae="tiny",
            timeouts={"cache": 240.0, "on_device": 240.0, "launch_script": 240.0},
        )


# -- what the rows share ------------------------------------------------------------------


def tiny_clip(variant: str) -> dict:
    """The smallest clip ``variant`` trains on with a reference VAE (``--tiny``): 9 frames of
    8x8 for taecvx."""
    spec = get_variant(variant)
    frames = [t for t in spec.exact_frame_counts(64) if reference_vae_frames(t, spec)][0]
    side = 8 * spec.patch_size
    return {"n_frames": frames, "height": side, "width": side}


def prepare_clips(plan: Plan, folder: Path) -> dict:
    """The first ``max_clips`` clips (their first ``max_frames`` frames) re-encoded as the
    users' data (720x480 H.264, GOP 30; ``--tiny``: two 30-frame clips at 96x64) and an
    annotation listing them over and over, one epoch of ``clips_per_epoch`` entries: long
    enough that its boundaries (the workers' pipeline drains and refills) cost the loader
    little."""
    width, height = (96, 64) if plan.tiny else (720, 480)
    started = time.perf_counter()
    entries = reencode_clips(plan.videos_dir, folder / "clips", width, height, plan.max_clips, plan.max_frames)
    annotation = folder / "train.json"
    write_annotation(annotation, [entries[i % len(entries)] for i in range(plan.clips_per_epoch)])
    seconds = time.perf_counter() - started
    log(f"e2e: {len(entries)} clips re-encoded to {width}x{height} H.264 in {seconds:.1f} s")
    return {
        "data_root": str(folder / "clips"),
        "annotation_file": str(annotation),
        "videos": {entry["path"]: entry["frames"] for entry in entries},
        "size": f"{width}x{height}",
        "codec": f"H.264, a keyframe every {DASH_CAMERA_GOP} frames",
        "entries_per_epoch": plan.clips_per_epoch,
        "reencode_s": round(seconds, 1),
    }


def data_overrides(plan: Plan, clips: dict, reference: Path | None) -> list[str]:
    """The ``--key=value`` overrides both rows of a feed run the preset with: the clips, no
    validation set, from scratch (the preset fine-tunes checkpoints/taecvx.pth, which a
    benchmark machine may lack; the step costs the same), the reference VAE and latent cache
    of ``reference`` or none, and ``--tiny``'s sizes."""
    overrides = {
        "data_root": clips["data_root"],
        "annotation_file": clips["annotation_file"],
        "val_annotation_file": "",
        "pretrained_model_path": "",
        "ref_vae_path": str(reference / "vae") if reference else "",
    }
    if reference:
        overrides["latent_cache_dir"] = str(reference / "cache")
    if plan.workers is not None:
        overrides["dataloader_num_workers"] = plan.workers
    if plan.compile_backend != "inductor":
        overrides["compile_backend"] = plan.compile_backend
    if plan.tiny:  # and windows of 2 micro-batches: seconds per row on a CPU
        overrides |= {**tiny_clip(PRESET_VARIANT), "mixed_precision": "no", "gradient_accumulation_steps": 2}
    elif plan.device != "cuda":
        overrides["mixed_precision"] = "no"
    return [f"--{key}={value}" for key, value in overrides.items()]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a row's processes: this one's, the same Python for the launch
    script, and the repository importable."""
    env = {**os.environ, "PYTHON": sys.executable, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


@dataclass
class Finished:
    status: int | None  # None: killed at the time bound
    seconds: float
    output: str  # the tail of its stdout and stderr


def stop_tree(process: subprocess.Popen) -> None:
    """Kill ``process`` and every process under it. Torch elastic starts each training rank
    in its own session, so a signal to the process group would miss them: the tree is
    frozen, listed again (for anything started meanwhile) and killed."""
    try:
        root = psutil.Process(process.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for proc in tree:
        try:
            proc.suspend()
        except psutil.Error:
            pass
    with_new = list(tree)
    for proc in tree:
        try:
            with_new += [p for p in proc.children(recursive=True) if p not in with_new]
        except psutil.Error:
            pass
    for proc in with_new:
        try:
            proc.kill()
        except psutil.Error:
            pass
    process.wait()


def run_bounded(
    command: list[str], timeout: float, log_file: Path, env: dict[str, str], stdout_file: Path | None = None
) -> Finished:
    """Run ``command`` from the repository root, its output into ``log_file`` (its stdout
    into ``stdout_file`` when given); killed with every process it started after
    ``timeout`` seconds."""
    log(f"run (at most {timeout:.0f} s): {shlex.join(command)}")
    started = time.perf_counter()
    with open(log_file, "w") as out, open(stdout_file or os.devnull, "w") as stdout:
        process = subprocess.Popen(
            command,
            stdout=stdout if stdout_file else out,
            stderr=out if stdout_file else subprocess.STDOUT,
            cwd=REPO_ROOT,
            env=env,
            start_new_session=True,
        )
        try:
            status = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_tree(process)
            status = None
    seconds = time.perf_counter() - started
    return Finished(status, seconds, log_file.read_text(errors="replace")[-LOG_TAIL:])


def failure(finished: Finished, timeout: float, what: str) -> str:
    if finished.status is None:
        return (
            f"TimeoutError: {what} ran past its bound of {timeout:.0f} s and was killed; "
            f"its output ended:\n{finished.output}"
        )
    return f"{what} exited with status {finished.status}; its output ended:\n{finished.output}"


# -- the latent cache ---------------------------------------------------------------------


def prepare_cache(plan: Plan, clips: dict, reference: Path, timeout: float | None = None) -> dict:
    """A reference VAE with random weights (none can be downloaded on a benchmark machine)
    in ``reference/vae`` and the latent cache of the clips in ``reference/cache``, built by
    the command users run (``python -m taehv_train.training.build_latent_cache``). The cached step never
    runs the VAE, so the VAE's size does not change the rows' speed. Raises on failure."""
    description, architecture = CACHE_VAES[plan.cache_vae]
    save_reference_vae(reference / "vae", architecture)  # ref_vae_path: the folder whose vae/ holds it
    overrides = [o for o in data_overrides(plan, clips, reference) if not o.startswith("--latent_cache_dir=")]
    command = [
        sys.executable,
        "-m",
        "taehv_train.training.build_latent_cache",
        "--config",
        str(PRESET.relative_to(REPO_ROOT)),
        *overrides,
        "--output",
        str(reference / "cache"),
    ]
    timeout = plan.timeouts["cache"] if timeout is None else timeout
    finished = run_bounded(command, timeout, reference / "build_latent_cache.log", child_env())
    if finished.status != 0:
        raise RuntimeError(failure(finished, timeout, "the latent cache build"))
    return {
        "reference_vae": f"{description}, random weights",
        "cache_command": shlex.join(command),
        "cache_build_s": round(finished.seconds, 1),
    }


# -- the ceiling: the same engine fed batches on the device -------------------------------


def on_device_command(plan: Plan, overrides: list[str], out: Path) -> list[str]:
    """bench/lib/on_device_step.py started as the launch script starts one training process:
    on CUDA through accelerate_configs/deepspeed_1gpu.yaml, on a CPU as a one-process
    DeepSpeed ZeRO-2 run (gloo)."""
    if plan.device == "cuda":
        launch = ["--config_file", ONE_GPU_YAML, "--num_processes", "1"]
    else:
        launch = ["--use_deepspeed", "--zero_stage", "2", "--num_machines", "1", "--num_processes", "1"]
    return [
        sys.executable,
        "-m",
        "taehv_train.training.launch",
        *launch,
        "--main_process_port",
        str(free_port()),
        "-m",
        "bench.lib.on_device_step",
        "--config",
        str(PRESET.relative_to(REPO_ROOT)),
        *overrides,
        "--seconds",
        str(plan.on_device_seconds),
        "--warmup",
        str(plan.warmup_windows),
        "--out",
        str(out),
    ]


def on_device_row(plan: Plan, overrides: list[str], folder: Path, timeout: float | None = None) -> dict:
    """The on-device row's figures (bench/lib/on_device_step.py's JSON) and its command."""
    out = folder / "on_device.json"
    command = on_device_command(plan, overrides, out)
    timeout = plan.timeouts["on_device"] if timeout is None else timeout
    finished = run_bounded(command, timeout, folder / "on_device.log", child_env())
    row = {"command": shlex.join(command), "wall_s": round(finished.seconds, 1)}
    if finished.status != 0 or not out.is_file():
        raise RowFailed(row, failure(finished, timeout, "the on-device step"))
    return row | json.loads(out.read_text())


# -- the command users type ---------------------------------------------------------------


class RowFailed(RuntimeError):
    """A row's process failed or ran out of time; ``row`` keeps what it did measure."""

    def __init__(self, row: dict, message: str):
        super().__init__(message)
        self.row = row


def launch_script_command(plan: Plan, overrides: list[str], output_dir: Path, run_time_s: float) -> list[str]:
    length = [f"--max_train_steps={plan.run_steps}"] if plan.run_steps else [f"--max_train_time={run_time_s:.0f}s"]
    return [
        LAUNCH_SCRIPT,
        "1",
        PRESET_NAME,
        *overrides,
        f"--output_dir={output_dir}",
        *length,
        # no validation set: nothing to spread over the budget, and no checkpoint every tenth of the run
        "--validations_per_budget=0",
        f"--log_every={plan.log_every}",
    ]


def logged_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The run's TensorBoard scalars under ``train/``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "logs"), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: [(event.step, event.value) for event in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
        if tag.startswith("train/")
    }


def run_figures(scalars: dict[str, list[tuple[int, float]]], config: dict, warmup_steps: int) -> dict:
    """The run's speed after its first ``warmup_steps`` steps, from its log steps. A log
    step's ``train/samples_per_second`` covers the steps since the previous log step, which
    took (steps x clips per step / that rate) seconds: clips/s is the clips of the kept
    intervals over their seconds, and the other figures are the intervals' values weighted
    by their seconds."""
    rates = dict(scalars.get("train/samples_per_second", []))
    steps = sorted(rates)
    kept = [(before, step) for before, step in zip([0, *steps], steps) if step > warmup_steps and rates[step] > 0]
    if not kept:
        raise ValueError(
            f"no log step after the first {warmup_steps} steps (logged at steps {steps}): "
            "the run was too short to measure"
        )
    clips_per_step = config["train_batch_size"] * config["gradient_accumulation_steps"]  # one process
    seconds = {step: (step - before) * clips_per_step / rates[step] for before, step in kept}
    total = sum(seconds.values())

    def weighted(tag: str) -> float | None:
        values = dict(scalars.get(tag, []))
        if not all(step in values for step in seconds):
            return None
        return round(sum(values[step] * s for step, s in seconds.items()) / total, 4)

    clips = sum(step - before for before, step in kept) * clips_per_step
    memory = [value for _, value in scalars.get("train/gpu_memory_gb", [])]
    return {
        "log_steps": [step for _, step in kept],
        "seconds": round(total, 2),
        "steps": kept[-1][1] - kept[0][0],
        "clips_per_s": round(clips / total, 3),
        "frames_per_s": round(clips * config["n_frames"] / total, 2),
        "tflops": weighted("train/tflops"),
        "mfu": weighted("train/mfu"),
        "data_wait": weighted("train/data_wait"),
        "gpu_idle": weighted("train/gpu_idle"),
        "gpu_memory_gb": round(max(memory), 2) if memory else None,
        "last_loss": scalars["train/loss"][-1][1] if scalars.get("train/loss") else None,
    }


def log_lines(run_dir: Path) -> dict:
    """What the run's train.log says about its speed: its last log step's line, whether that
    line names the GPU's idle share and the MFU, and whether the run compiled the model."""
    text = (run_dir / "train.log").read_text(errors="replace") if (run_dir / "train.log").is_file() else ""
    lines = [match.group(2) for match in map(STEP_LINE.search, text.splitlines()) if match]
    last = lines[-1] if lines else None
    return {
        "log_line": last,
        "log_line_has_gpu_idle": last is not None and "GPU idle" in last,
        "log_line_has_mfu": last is not None and "MFU" in last,
        "compiled": "torch.compile (backend" in text,
    }


def launch_script_row(
    plan: Plan, overrides: list[str], folder: Path, timeout: float | None = None, run_time_s: float | None = None
) -> dict:
    """``./train_taehv_h100.sh 1 1gpu_h100`` with ``overrides``, into a fresh output folder,
    for ``run_time_s`` seconds (``--max_train_time``; ``--tiny``: a few steps); its figures
    from its TensorBoard scalars after its first steps, and its log line."""
    output_dir = folder / "runs"
    command = launch_script_command(plan, overrides, output_dir, plan.run_time_s if run_time_s is None else run_time_s)
    timeout = plan.timeouts["launch_script"] if timeout is None else timeout
    finished = run_bounded(command, timeout, folder / "launch_script.log", child_env(MASTER_PORT=str(free_port())))
    row: dict = {"command": shlex.join(command), "wall_s": round(finished.seconds, 1), "exit_status": finished.status}
    runs = sorted(p for p in output_dir.iterdir() if p.is_dir()) if output_dir.is_dir() else []
    if runs:
        run_dir = runs[-1]
        config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else None
        row |= {"run_dir": run_dir.name, **log_lines(run_dir)}
        try:
            scalars = logged_scalars(run_dir)
            row["tags"] = sorted(scalars)
            if config is not None:
                row |= run_figures(scalars, config, plan.warmup_steps)
                row["warmup_steps_left_out"] = plan.warmup_steps
        except ValueError as err:
            if finished.status == 0:
                raise RowFailed(row, f"{err} ({finished.seconds:.0f} s)") from None
    if finished.status != 0:
        raise RowFailed(row, failure(finished, timeout, "the launch script"))
    if "clips_per_s" not in row:
        raise RowFailed(row, f"the run logged no training speed; its output ended:\n{finished.output}")
    return row


# -- both rows of both feeds --------------------------------------------------------------


def settings(plan: Plan, clips: dict) -> dict:
    """What the end-to-end rows share."""
    return {
        "preset": str(PRESET.relative_to(REPO_ROOT)),
        "variant": PRESET_VARIANT,
        **({"tiny_clip": tiny_clip(PRESET_VARIANT)} if plan.tiny else {}),
        "device": plan.device,
        "clips": {key: value for key, value in clips.items() if key not in ("data_root", "annotation_file")},
        "workers": plan.workers if plan.workers is not None else "the preset's",
        "on_device": {
            "seconds": plan.on_device_seconds,
            "warmup_windows": plan.warmup_windows,
            "launch": "training.launch, as the launch script launches one process"
            + (f" ({ONE_GPU_YAML})" if plan.device == "cuda" else " (DeepSpeed ZeRO-2 on the CPU, gloo)"),
        },
        "launch_script": {
            "length": (
                f"--max_train_steps={plan.run_steps}" if plan.run_steps else f"--max_train_time={plan.run_time_s:.0f}s"
            ),
            "log_every": plan.log_every,
            "warmup_steps_left_out": plan.warmup_steps,
            "figures_from": "TensorBoard train/* scalars of the run's logs/ (train.log's line for the log line)",
        },
        "cache_vae": CACHE_VAES[plan.cache_vae][0],
        "timeouts_s": plan.timeouts,
    }


def with_ratio(rows: dict[str, dict]) -> None:
    """The launch script's clips/s over the on-device row's, on the launch script's row."""
    on_device, launched = rows["on_device"], rows["launch_script"]
    if on_device.get("clips_per_s") and launched.get("clips_per_s"):
        launched["ratio_to_on_device"] = round(launched["clips_per_s"] / on_device["clips_per_s"], 3)


def record(row: dict, err: Exception) -> None:
    """A row that failed keeps what it measured and gets an ``error`` field; the others still run."""
    if isinstance(err, RowFailed):
        row.update({key: value for key, value in err.row.items() if key not in row})
        row["error"] = str(err)[:4000]
    elif isinstance(err, NotRun):
        row["error"] = str(err)
    else:
        row["error"] = f"{type(err).__name__}: {err}"[:4000]
    log(f"FAILED e2e {row.get('feed')} {row.get('setting')}: {row['error'][:600]}")


def log_row(row: dict) -> None:
    def share(key: str, label: str) -> str:
        return "" if row.get(key) is None else f"  {label} {row[key]:.1%}"

    log(
        f"e2e {row['feed']:6s} {row['setting']:13s} {row['clips_per_s']:8.3f} clips/s {row['frames_per_s']:9.1f} "
        f"frames/s" + share("data_wait", "data wait") + share("gpu_idle", "GPU idle") + share("mfu", "MFU")
    )


def end_to_end_rows(plan: Plan, folder: Path) -> tuple[dict, list[dict]]:
    """For each feed (``plain``: no reference latents; ``cached``: reference latents from a
    latent cache built for the clips), the on-device row, then the launch script's row
    (the on-device process compiles first, so the launch script's run finds inductor's
    cache warm). A row that fails or runs out of time gets an ``error`` field; the rest run."""
    clips = prepare_clips(plan, folder)
    rows: list[dict] = []
    for feed in E2E_FEEDS:
        rows += feed_rows(plan, clips, feed, folder / feed)
    return settings(plan, clips), rows


class NotRun(RuntimeError):
    """A row left out because the time it was given is spent (bench/gpu_check.py's budget)."""


def feed_rows(
    plan: Plan, clips: dict, feed: str, folder: Path, bound: Callable[[str], float] | None = None
) -> list[dict]:
    """The on-device and launch-script rows of one feed. ``bound(part)`` gives the time
    bound of a part ("cache", "on_device", "launch_script") when it starts (or raises
    NotRun); by default the plan's. The launch script's run is given its bound less
    ``launch_overhead_s`` (its start-up before the budget counts, the final checkpoint and
    export), at most ``run_time_s``."""
    bound = bound or plan.timeouts.__getitem__
    folder.mkdir(parents=True, exist_ok=True)
    rows = {setting: {"feed": feed, "setting": setting} for setting in E2E_SETTINGS}
    reference = folder / "reference" if feed == "cached" else None
    try:
        cache = prepare_cache(plan, clips, reference, bound("cache")) if reference else {"reference_vae": None}
    except Exception as err:  # the cache failed: recorded (and logged) in both rows, the next feed still runs
        for row in rows.values():
            record(row, err)
        return list(rows.values())
    overrides = data_overrides(plan, clips, reference)
    for setting, row in rows.items():
        row.update(cache)
        try:
            timeout = bound(setting)
            if setting == "on_device":
                row.update(on_device_row(plan, overrides, folder, timeout))
            else:
                run_time_s = min(plan.run_time_s, timeout - plan.launch_overhead_s)
                row.update(launch_script_row(plan, overrides, folder, timeout, run_time_s))
            log_row(row)
        except Exception as err:  # recorded in the row; the next row still runs
            record(row, err)
    with_ratio(rows)
    return list(rows.values())
