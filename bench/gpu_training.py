"""bench/bench_gpu.py's training rows: the 1gpu_h100 preset's step on one in-memory batch,
eager and compiled, and the preset training end to end, fed from the device and by the
real loader (plain and with cached reference latents); its docstring says what each
row measures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from bench.gpu_measure import GraphCount, PeakMemory, check_compiled, free, kwargs_text, log, record_failure
from bench.harness import REPO_ROOT
from bench.make_reference_vae import COGVIDEOX_2B, TINY_COGVIDEOX, save_reference_vae
from bench.reencoded_clips import DASH_CAMERA_GOP, reencode_clips
from bench.step_builder import build_step, train_step
from common.config import TrainConfig, load_config
from evaluation.timing import median_seconds, synchronize
from models import taehv as taehv_module
from models.taehv import TAEHV
from models.vae_registry import reference_vae_frames
from models.variants import get_variant
from training.build_latent_cache import build_cache
from training.data.loading import ReferenceLatents, build_train_loader, build_training_data
from training.data.prefetch import Prefetcher
from training.loop.feed import micro_batch_flops, peak_flops
from training.loop.optimisation import compiles
from training.loop.step import StepResult, TrainStep
from training.make_annotations import write_annotation
from training.preflight import check
from training.taehv_train import Progress

PRESET = REPO_ROOT / "training" / "configs" / "taehv_config_1gpu_h100.py"
E2E_FEEDS = ("plain", "cached")  # reference latents: none, or from the latent cache
E2E_SETTINGS = ("on_device", "loader")


# -- training step ------------------------------------------------------------------------


def tiny_clip(variant: str) -> dict:
    """The smallest clip ``variant`` trains on with a reference VAE (``--tiny``): 9 frames of
    8x8 for taecvx."""
    spec = get_variant(variant)
    frames = [t for t in spec.exact_frame_counts(64) if reference_vae_frames(t, spec)][0]
    side = 8 * spec.patch_size
    return {"n_frames": frames, "height": side, "width": side}


def training_config(args, device: torch.device) -> TrainConfig:
    """The 1gpu_h100 preset, or on ``--tiny`` the smallest clip it allows (and no mixed precision)."""
    config = load_config(PRESET)
    if args.tiny:
        config = config.replace(**tiny_clip(config.variant), mixed_precision="no")
    elif device.type != "cuda":
        config = config.replace(mixed_precision="no")
    return config


def train_row(
    args, device: torch.device, config: TrainConfig, batch: dict, compiled: bool, has_key: bool, compile_kwargs: dict
) -> dict:
    """One setting of the training step: time, throughput, peak memory (model, optimizer state
    and activations: measured from before the step is built), losses."""
    peak = PeakMemory(device)
    peak.start()
    torch.manual_seed(0)  # the same initial weights in every setting: the losses must agree
    # every call a window of one micro-batch with its optimizer step
    step = train_step(
        config.replace(gradient_accumulation_steps=1), device, ReferenceLatents(None, cached=True), config.use_seraena
    )
    how = "eager"
    if compiled:
        if step.unwrapped_model.run_blocks is not taehv_module.run_blocks:
            how = f"config.replace(compile=True, compile_backend={config.compile_backend!r})"
        else:
            step.unwrapped_model.compile(**compile_kwargs)
            how = f"model.compile({kwargs_text(compile_kwargs)}) on the step's model" + (
                " (config.compile=True did not compile it)" if has_key else " (the config has no compile keys)"
            )
    windows = iter(range(1, 1 << 30))
    results = []

    def run() -> None:
        result = step(iter([batch]), next(windows))  # a window of one micro-batch
        if not result.applied:
            raise RuntimeError(f"training step skipped its optimizer step: {result.skip_reason}")
        results.append(result)

    graphs = GraphCount()
    run()  # first warm-up step: compiles when compiled
    compiled_graphs = graphs.step()
    seconds, _ = median_seconds(run, device, args.warmup - 1, args.repeats)
    row = {
        "compile": how,
        "step_s": round(seconds, 6),
        "steps_per_s": round(1 / seconds, 3),
        "images_per_s": round(config.train_batch_size * config.n_frames / seconds, 2),
        "peak_mb": round(peak.mb(), 1),
        "first_loss": float(results[0].losses[0]["loss"]),
        "last_loss": float(results[-1].losses[0]["loss"]),
        "graphs_compiled_first_call": compiled_graphs,
        "graphs_compiled_timed": graphs.step(),
    }
    check_compiled(row, compiled)
    return row


def training_rows(
    args, device: torch.device, compile_settings: list[bool], compile_kwargs: dict
) -> tuple[dict, list[dict]]:
    base = training_config(args, device)
    has_key = {"compile", "compile_backend"} <= {f.name for f in dataclasses.fields(TrainConfig)}
    model = TAEHV(variant=base.variant)
    size = (base.height // (8 * model.patch_size), base.width // (8 * model.patch_size))
    torch.manual_seed(0)
    frames = torch.randint(
        0, 256, (base.train_batch_size, base.n_frames, 3, base.height, base.width), dtype=torch.uint8
    )
    z_ref = torch.randn(
        base.train_batch_size, model.plan(base.n_frames).latent_frames, model.latent_channels, *size, device=device
    )
    del model
    batch = {"frames": frames, "latents": z_ref}
    rows = []
    for compiled in compile_settings:
        row = {"setting": "compiled" if compiled else "eager"}
        try:
            config = (
                base.replace(compile=str(compiled).lower(), compile_backend=args.compile_backend) if has_key else base
            )
            row.update(train_row(args, device, config, batch, compiled, has_key, compile_kwargs))
            if rows and "first_loss" in rows[0]:
                row["first_loss_diff_vs_eager"] = abs(row["first_loss"] - rows[0]["first_loss"])
            log(
                f"train step {row['setting']:8s} {row['step_s']:.4f} s {row['images_per_s']:9.1f} images/s "
                f"{row['peak_mb']:8.1f} MB  loss {row['last_loss']:.4f}"
            )
        except Exception as err:  # recorded in the row; main() exits 1 after the JSON
            record_failure(row, err)
        rows.append(row)
        torch._dynamo.reset()
        free(device)
    setup = {
        "preset": str(PRESET.relative_to(REPO_ROOT)),
        "variant": base.variant,
        "n_frames": base.n_frames,
        "height": base.height,
        "width": base.width,
        "batch": base.train_batch_size,
        "mixed_precision": base.mixed_precision,
        "use_seraena": base.use_seraena,
        "use_ema": base.use_ema,
        "reference_latents": "in the batch (as the latent cache delivers them), random",
        "optimizer_step_every_call": True,
        "preset_gradient_accumulation_steps": base.gradient_accumulation_steps,
    }
    return setup, rows


# -- end-to-end training ------------------------------------------------------------------


@contextlib.contextmanager
def cudnn_benchmark(enabled: bool) -> Iterator[None]:
    """cuDNN's benchmark mode set to ``enabled`` inside (training leaves it off; the model rows turn it on)."""
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous


def e2e_clips(args, folder: Path) -> dict:
    """The shared clips re-encoded as the users' data (720x480 H.264, GOP 30; ``--tiny``: two
    30-frame clips at 96x64) and an annotation listing them over and over, ``--e2e_clips``
    entries: epochs long enough that their boundaries (the workers' pipeline drains and
    refills) cost the loader little."""
    width, height, clips, max_frames = (96, 64, 2, 30) if args.tiny else (720, 480, None, None)
    started = time.perf_counter()
    entries = reencode_clips(args.videos_dir, folder / "clips", width, height, clips, max_frames)
    annotation = folder / "train.json"
    write_annotation(annotation, [entries[i % len(entries)] for i in range(args.e2e_clips)])
    log(f"e2e: {len(entries)} clips re-encoded to {width}x{height} H.264 in {time.perf_counter() - started:.1f} s")
    return {
        "data_root": str(folder / "clips"),
        "annotation_file": str(annotation),
        "videos": {entry["path"]: entry["frames"] for entry in entries},
        "size": f"{width}x{height}",
        "codec": f"H.264, a keyframe every {DASH_CAMERA_GOP} frames",
        "entries_per_epoch": args.e2e_clips,
    }


def e2e_config(args, device: torch.device, clips: dict, reference: Path | None) -> TrainConfig:
    """The 1gpu_h100 preset (its batch, windows, workers, precision and ``compile``) training
    from scratch on ``clips`` without validation, with reference latents from the latent
    cache in ``reference`` (the VAE's folder and the cache's) or none; ``--tiny``: the
    training rows' clip size, no mixed precision."""
    overrides = {
        "data_root": clips["data_root"],
        "annotation_file": clips["annotation_file"],
        "val_annotation_file": "",
        "pretrained_model_path": "",
        "ref_vae_path": reference / "vae" if reference else "",
        "latent_cache_dir": reference / "cache" if reference else "",
        "compile_backend": args.compile_backend,
    }
    if args.workers is not None:
        overrides["dataloader_num_workers"] = args.workers
    if args.tiny:
        overrides |= {**tiny_clip(load_config(PRESET).variant), "mixed_precision": "no"}
    elif device.type != "cuda":
        overrides["mixed_precision"] = "no"
    return load_config(PRESET, [f"--{key}={value}" for key, value in overrides.items()])


def e2e_cache(args, config: TrainConfig) -> dict:
    """A reference VAE with random weights (none can be downloaded on a benchmark machine)
    and the latent cache of ``config``'s clips, made by the cache builder with it."""
    description, architecture = (
        ("tiny CogVideoX (4 channels per block, CogVideoX-2b's latent shape)", TINY_COGVIDEOX)
        if args.tiny
        else ("CogVideoX-2b architecture (bench/make_reference_vae.py)", COGVIDEOX_2B)
    )
    save_reference_vae(config.ref_vae_path, architecture)
    summary = build_cache(
        config, config.latent_cache_dir, batch_size=config.train_batch_size, num_workers=config.dataloader_num_workers
    )
    log(f"e2e: {summary}")
    return {
        "reference_vae": f"{description}, random weights",
        "cache_build_s": round(summary.seconds, 1),
        "cache_mb": round(summary.size_bytes / 2**20, 3),
    }


def device_batches(loader: DataLoader, accelerator: Accelerator, count: int, depth: int) -> list[dict]:
    """The prepared loader's first ``count`` batches, on the device, received as the step
    receives them (the prefetching thread)."""
    fetched = Prefetcher(loader, accelerator, Progress(), depth)
    try:
        return [next(fetched).batch for _ in range(count)]
    finally:
        fetched.close()


def run_windows(step: TrainStep, feed: Iterator, warmup: int, seconds: float) -> dict:
    """Accumulation windows of ``step`` fed from ``feed``: ``warmup`` of them (the first
    compiles when the config compiles), then as many as start within ``seconds``; the wall
    time of those (CUDA synchronised) and what they trained, waited and idled."""
    device = step.accelerator.device
    numbers = itertools.count(1)

    def window() -> StepResult:
        result = step(feed, next(numbers))
        if not result.applied:
            raise RuntimeError(f"training step skipped its optimizer step: {result.skip_reason or result.data_error}")
        return result

    graphs = GraphCount()
    for _ in range(warmup):
        window()
    synchronize(device)
    step.idle.take_seconds()  # the warm-up's gaps
    warmup_graphs = graphs.step()
    results = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        results.append(window())
    synchronize(device)
    return {
        "seconds": time.perf_counter() - started,
        "steps": len(results),
        "micro_batches": sum(result.micro_batches for result in results),
        "data_wait": sum(result.data_wait for result in results),
        "idle": step.idle.take_seconds(),
        "last_loss": float(results[-1].losses[-1]["loss"]),
        "graphs_compiled_warmup": warmup_graphs,
        "graphs_compiled_timed": graphs.step(),
    }


def e2e_figures(config: TrainConfig, device: torch.device, run: dict) -> dict:
    """A row's rates from ``run_windows``: clips and frames per second, the TAE's training
    TFLOP/s and MFU (None where the GPU's peak is unknown), and the shares of wall time the
    step waited for data and the GPU idled (None on a CPU)."""
    seconds, clips = run["seconds"], run["micro_batches"] * config.train_batch_size
    tflops = run["micro_batches"] * micro_batch_flops(config) / seconds / 1e12
    peak = peak_flops(device, config.mixed_precision)
    return {
        "seconds": round(seconds, 2),
        "steps": run["steps"],
        "micro_batches": run["micro_batches"],
        "clips_per_s": round(clips / seconds, 3),
        "frames_per_s": round(clips * config.n_frames / seconds, 2),
        "tflops": round(tflops, 4),
        "mfu": None if peak is None else round(tflops * 1e12 / peak, 4),
        "data_wait": round(run["data_wait"] / seconds, 4),
        "gpu_idle": None if run["idle"] is None else round(run["idle"] / seconds, 4),
        "last_loss": run["last_loss"],
        "graphs_compiled_warmup": run["graphs_compiled_warmup"],
        "graphs_compiled_timed": run["graphs_compiled_timed"],
    }


def measure_feed(args, device: torch.device, config: TrainConfig, rows: dict[str, dict]) -> None:
    """Fill the ``on_device`` and ``loader`` rows of one feed with one step (compiled once):
    first the step fed one window of real batches taken from the loader beforehand and
    cycled on the device (the ceiling), then the loader itself through the prefetching
    thread, as in training."""
    check(config)
    data = build_training_data(config, None)
    torch.manual_seed(0)
    step, loader = build_step(config, device, data.latents, build_train_loader(data.train, config, device))
    common = {"compile": config.compile, "compiled": compiles(config)}
    batches = device_batches(loader, step.accelerator, config.gradient_accumulation_steps, config.prefetch_batches)
    run = run_windows(step, itertools.cycle(batches), args.warmup, args.e2e_seconds)
    rows["on_device"].update(common, **e2e_figures(config, device, run))
    del batches
    free(device)
    fetched = Prefetcher(loader, step.accelerator, Progress(), config.prefetch_batches)
    try:
        run = run_windows(step, fetched, args.warmup, args.e2e_seconds)
    finally:
        fetched.close()
    rows["loader"].update(common, workers=config.dataloader_num_workers, **e2e_figures(config, device, run))
    rows["loader"]["ratio_to_on_device"] = round(rows["loader"]["clips_per_s"] / rows["on_device"]["clips_per_s"], 3)


def log_e2e_row(row: dict) -> None:
    log(
        f"e2e {row['feed']:6s} {row['setting']:9s} {row['clips_per_s']:8.3f} clips/s "
        f"{row['frames_per_s']:9.1f} frames/s  data wait {row['data_wait']:.1%}"
        + ("" if row["gpu_idle"] is None else f"  GPU idle {row['gpu_idle']:.1%}")
        + ("" if row["mfu"] is None else f"  MFU {row['mfu']:.1%}")
    )


def e2e_settings(config: TrainConfig, device: torch.device, clips: dict, args) -> dict:
    """What the end-to-end rows share: the preset's step and loader settings, the clips, the timing."""
    peak = peak_flops(device, config.mixed_precision)
    return {
        "preset": str(PRESET.relative_to(REPO_ROOT)),
        "variant": config.variant,
        "n_frames": config.n_frames,
        "height": config.height,
        "width": config.width,
        "batch": config.train_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "mixed_precision": config.mixed_precision,
        "compile": config.compile,
        "compiled": compiles(config),
        "compile_backend": config.compile_backend,
        "workers": config.dataloader_num_workers,
        "prefetch_factor": config.prefetch_factor,
        "prefetch_batches": config.prefetch_batches,
        "persistent_workers": config.persistent_workers,
        "clips": {key: value for key, value in clips.items() if key not in ("data_root", "annotation_file")},
        "seconds_per_row": args.e2e_seconds,
        "warmup_windows": args.warmup,
        "on_device_batches": f"the loader's first {config.gradient_accumulation_steps}, kept on the device, cycled",
        "peak_tflops": None if peak is None else peak / 1e12,
        "cudnn_benchmark": False,
    }


def end_to_end_rows(args, device: torch.device) -> tuple[dict, list[dict]]:
    """For each feed (``plain``: no reference latents; ``cached``: reference latents from a
    latent cache built for the clips), the step fed from the device and from the loader."""
    setup: dict = {}
    rows, clips = [], None
    with tempfile.TemporaryDirectory(prefix="bench_gpu_e2e_") as tmp, cudnn_benchmark(False):
        folder = Path(tmp)
        for feed in E2E_FEEDS:
            feed_rows = {setting: {"feed": feed, "setting": setting} for setting in E2E_SETTINGS}
            try:
                clips = clips or e2e_clips(args, folder)
                config = e2e_config(args, device, clips, folder / "reference" if feed == "cached" else None)
                setup = setup or e2e_settings(config, device, clips, args)
                reference = e2e_cache(args, config) if feed == "cached" else {"reference_vae": None}
                for row in feed_rows.values():
                    row.update(reference)
                measure_feed(args, device, config, feed_rows)
                for row in feed_rows.values():
                    log_e2e_row(row)
            except Exception as err:  # recorded in the rows it left unmeasured; main() exits 1 after the JSON
                for row in feed_rows.values():
                    if "clips_per_s" not in row:
                        record_failure(row, err)
            rows += feed_rows.values()
            torch._dynamo.reset()
            free(device)
    return setup, rows
