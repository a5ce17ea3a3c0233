#!/usr/bin/env python3
"""The GPU path in one command: our TAEHV against the published implementation, eager and
compiled, in bf16 and fp16, plus the 1gpu_h100 preset's training step, alone and fed by
the real loader; prints JSON.

    make bench-gpu                                      # the defaults below, on the GPU
    python -m bench.bench_gpu                           # the same
    python -m bench.bench_gpu --variants taehv1_5 --dtypes bf16 --frames 49 --out gpu.json
    python -m bench.bench_gpu --no-model --no-train --out e2e.json   # only the end-to-end rows
    python -m bench.bench_gpu --tiny                    # CPU: 9 frames of 32x32, fp32, eager, 1 repeat

Model rows, for each variant (``--variants``, default taew2_1 taehv1_5), dtype (``--dtypes``,
default bf16 fp16) and setting (eager; compiled unless ``--no_compile``), and for each
implementation (``ours``: models/taehv.py, cast with ``.to(device, dtype)`` and
``.to(memory_format=torch.channels_last)``; ``published``: the published taehv.py in
../shared/reference (``$TAEHV_SHARED_DIR/reference``, ``--published``), built with the
same architecture, loaded with our weights and cast with ``.to(device, dtype)`` as its
own main() does), three operations on the same inputs:

- ``encode``: ``encode_video(frames, parallel=True)`` of 1 x frames x 3 x height x width
  uniform frames (default 81 frames of 480x832);
- ``decode``: ``decode_video(latents, parallel=True)`` of standard normal latents of that
  clip's latent shape;
- ``stream_decode``: the same latents through the streaming API (``model.stream()``;
  the published ``StreamingTAEHV``), one latent per ``decode(latent)`` call, then
  ``decode()`` until it returns None.

Compiled: ours is ``model.compile(dynamic=False)`` (fullgraph), and for ``stream_decode``
``model.compile(dynamic=False, mode="reduce-overhead")`` on CUDA (CUDA graphs: the shapes
are fixed; ``--stream_compile_mode`` picks another mode); the published one is
``torch.compile(encode_video / decode_video, dynamic=False)`` and, for its stream, each
decoder block ``.compile(dynamic=False)`` in the default mode (its stream keeps block
outputs between calls). ``dynamic=False``: without it the second shape a compiled
function sees (the decoder's after the encoder's) is recompiled with symbolic shapes.
Dynamo's caches are reset between settings.

Each row: median seconds over ``--repeats`` runs after ``--warmup`` runs (the first
warm-up run compiles; CUDA synchronised), frames per second (input frames for encode,
output frames for the decoders), peak memory above what was allocated before the first
run (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``; on CPU the
growth of the process' resident high-water mark, reset before each measurement through
/proc/self/clear_refs where Linux has it; compiled rows include the compiler's memory
there), and each ``ours`` row the speed-up over the published row of the same variant,
dtype, setting and operation and the max abs difference of its output from that row's
output. Ours and the published model alternate operation by operation in one process;
outputs, models and caches are freed between measurements. A compiled row that compiled
no graph (it would time eager code) is an error. A measurement that raises gets an
``error`` field in its row and its traceback on stderr; the others still run, and the
command exits with status 1 after printing the JSON.

Training rows: ``training.loop.step.TrainStep`` (the loop's step, built by
bench/bench_train_step.py's ``train_step``) on the 1gpu_h100 preset's clip size, batch,
variant and mixed precision, with reference latents in the batch as the latent cache
delivers them (random, of the right shape); every call is one micro-batch with its
optimizer step (no accumulation window). Eager, and compiled with
``config.replace(compile=True, compile_backend=...)`` (as in training: ``TrainStep.build``
compiles the model), or, with a config without those keys, ``model.compile()`` on the
step's model (the row says which). ``--tiny`` uses the smallest clip the preset allows
with a reference VAE (9 frames of 8x8 for taecvx) and no mixed precision.

End-to-end rows: the 1gpu_h100 preset training from scratch as the training loop runs it
(its batch, accumulation windows, mixed precision, ``dataloader_num_workers`` or
``--workers``, prefetching, and ``compile``: "auto" compiles on CUDA, the rows say
whether) on the shared clips (``--videos_dir``) re-encoded to 720x480 H.264 with a
keyframe every 30 frames (bench/reencoded_clips.py), listed over and over in an
annotation of ``--e2e_clips`` entries (one epoch). Two feeds: ``plain`` (no reference
latents) and ``cached`` (reference latents from the latent cache that
training/build_latent_cache.py builds for those clips with a CogVideoX-2b-architecture
VAE of random weights: none can be downloaded on a benchmark machine). Each feed's step
(the Accelerator, ``TrainStep.build`` and the loader from
``training.data.loading.build_train_loader``, prepared with the model, as in training) is
measured twice: ``on_device``, fed the loader's first window of batches kept on the
device and cycled (the ceiling), then ``loader``, fed by the loader through the training's
prefetching thread (``training.data.prefetch.Prefetcher``). A row runs ``--warmup``
windows, then windows for ``--e2e_seconds`` (CUDA synchronised at both ends; cuDNN's
benchmark mode off, as in training), and gives clips/s, frames/s, the TAE's training
TFLOP/s and MFU (``training.loop.feed``; null where the GPU's peak is unknown),
``data_wait`` (the step's waits for batches) and ``gpu_idle`` (its ``IdleClock``; null on
a CPU) as shares of the wall time, the optimizer steps, and for a loader row
``ratio_to_on_device`` (its clips/s over the on-device row's). ``--tiny``: two 30-frame
clips at 96x64, the tiny training clip, a tiny CogVideoX VAE (the same latent shape),
32 clips per epoch, 1 worker, 1 s per row.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import itertools
import json
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from accelerate import Accelerator
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

REPO_ROOT = Path(__file__).resolve().parents[1]
from bench.bench_speed import load_published, published_file, shared_dir
from bench.bench_train_step import build_step, train_step
from bench.make_reference_vae import COGVIDEOX_2B, TINY_COGVIDEOX, save_reference_vae
from bench.reencoded_clips import DASH_CAMERA_GOP, reencode_clips
from common.config import DTYPES, TrainConfig, load_config
from common.flags import ArgumentParser
from evaluation.timing import median_seconds, synchronize
from models import taehv as taehv_module
from models.taehv import TAEHV
from models.vae_registry import reference_vae_frames
from models.variants import get_variant, known_variants
from training.build_latent_cache import build_cache
from training.data.loading import ReferenceLatents, build_train_loader, build_training_data
from training.data.prefetch import Prefetcher
from training.loop.feed import micro_batch_flops, peak_flops
from training.loop.monitoring import peak_rss_bytes
from training.loop.optimisation import compiles
from training.loop.step import StepResult, TrainStep
from training.make_annotations import write_annotation
from training.preflight import check
from training.taehv_train import Progress

PUBLISHED_PATH = published_file("taew2_1")
PRESET = REPO_ROOT / "training" / "configs" / "taehv_config_1gpu_h100.py"
OPS = ("encode", "decode", "stream_decode")
IMPLEMENTATIONS = ("ours", "published")
CLEAR_REFS = Path("/proc/self/clear_refs")
E2E_FEEDS = ("plain", "cached")  # reference latents: none, or from the latent cache
E2E_SETTINGS = ("on_device", "loader")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- memory -------------------------------------------------------------------------------


def _current_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS line in /proc/self/status")


def cpu_peak_method() -> str:
    if CLEAR_REFS.exists():
        return "growth of VmHWM over VmRSS, high-water mark reset before each measurement (/proc/self/clear_refs)"
    return "growth of the process' peak RSS (a high-water mark that cannot be reset here: 0 below earlier peaks)"


class PeakMemory:
    """Peak memory of what runs between ``start()`` and ``mb()``, above what was allocated at ``start()``."""

    def __init__(self, device: torch.device):
        self.device, self.base = device, 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        elif CLEAR_REFS.exists():
            CLEAR_REFS.write_text("5")  # VmHWM := VmRSS
            self.base = _current_rss_bytes()
        else:
            self.base = peak_rss_bytes()

    def mb(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20
        return max(peak_rss_bytes() - self.base, 0) / 2**20


def free(device: torch.device) -> None:
    """Release what the last measurement left (run after dropping references)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# -- the two implementations ----------------------------------------------------------------


def check_variant(name: str) -> None:
    spec = get_variant(name)
    if spec.arch_variant == "wide" or spec.h3_chunks:
        raise ValueError(
            f"{name}: the published taehv.py has no {'wide decoder' if spec.arch_variant == 'wide' else 'H3 stream'}; "
            "compare base or super variants"
        )


def build_pair(P, variant: str, device: torch.device, dtype: torch.dtype) -> tuple[TAEHV, torch.nn.Module]:
    """Ours and the published model with the same (random, seeded) weights, cast to ``dtype``."""
    torch.manual_seed(0)
    ours = TAEHV(variant=variant).eval()
    published = P.TAEHV(
        checkpoint_path=None,
        encoder_time_downscale=ours.encoder_time_downscale,
        decoder_time_upscale=ours.decoder_time_upscale,
        patch_size=ours.patch_size,
        latent_channels=ours.latent_channels,
        arch_variant="super" if ours.arch_variant == "super" else None,
    ).eval()
    published.is_cogvideox = ours.is_cogvideox  # the published file tells it from the checkpoint's name
    published.load_state_dict(ours.state_dict())
    ours = ours.to(device, dtype).to(memory_format=torch.channels_last)
    published = published.to(device, dtype)
    return ours, published


def stream_decode(stream, latents: torch.Tensor) -> torch.Tensor:
    """Latents through a streaming decoder one at a time, every frame it gives."""
    frames = []
    for t in range(latents.shape[1]):
        frame = stream.decode(latents[:, t : t + 1])
        while frame is not None:
            frames.append(frame)
            frame = stream.decode()
    return torch.cat(frames, 1)


def operations(
    P, impl: str, model, frames_in: torch.Tensor, latents: torch.Tensor, compiled: bool, compile_kwargs: dict
) -> dict[str, Callable[[], torch.Tensor]]:
    """The three operations of one implementation, compiled or not (compiled ops compile on first call)."""
    if impl == "ours":
        encode, decode = model.encode_video, model.decode_video
        if compiled:
            model.compile(**compile_kwargs)
        return {
            "encode": lambda: encode(frames_in, parallel=True),
            "decode": lambda: decode(latents, parallel=True),
            "stream_decode": lambda: stream_decode(model.stream(), latents),
        }
    encode = lambda x: model.encode_video(x, parallel=True, show_progress_bar=False)  # noqa: E731
    decode = lambda z: model.decode_video(z, parallel=True, show_progress_bar=False)  # noqa: E731
    if compiled:
        encode, decode = torch.compile(encode, **compile_kwargs), torch.compile(decode, **compile_kwargs)
    return {
        "encode": lambda: encode(frames_in),
        "decode": lambda: decode(latents),
        "stream_decode": lambda: stream_decode(P.StreamingTAEHV(model), latents),
    }


def stream_compile(impl: str, model, compile_kwargs: dict, device: torch.device, mode: str) -> str:
    """Compile what the stream runs (after the parallel ops); returns the description for the row."""
    torch._dynamo.reset()
    if impl == "ours":
        kwargs = dict(compile_kwargs)
        if device.type == "cuda" and kwargs.get("backend", "inductor") == "inductor" and mode != "default":
            kwargs["mode"] = mode  # reduce-overhead: CUDA graphs (one latent per call, fixed shapes)
        model.compile(**kwargs)
        return f"model.compile({_kwargs_text(kwargs)})"
    for block in model.decoder:
        block.compile(**compile_kwargs)
    return f"each decoder block .compile({_kwargs_text(compile_kwargs)})"


def _kwargs_text(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


class GraphCount:
    """Graphs Dynamo compiled since the last ``step()`` (or construction)."""

    def __init__(self):
        self.last = self._now()

    @staticmethod
    def _now() -> int:
        return counters["stats"]["unique_graphs"]

    def step(self) -> int:
        now = self._now()
        new, self.last = now - self.last, now
        return new


def record_failure(row: dict, err: Exception) -> None:
    """A measurement that raised: its error goes into its row and, with the traceback, to stderr;
    the other measurements go on and the command exits with status 1 (``main``)."""
    row["error"] = f"{type(err).__name__}: {err}"[:4000]
    log(
        f"FAILED {json.dumps({k: v for k, v in row.items() if k != 'error'})}:\n"
        + "".join(traceback.format_exception(err))
    )


def check_compiled(row: dict, compiled: bool) -> None:
    """A compiled row that compiled nothing ran eagerly (e.g. Dynamo's recompile limit): refuse it."""
    if compiled and row["graphs_compiled_first_call"] == 0:
        raise RuntimeError(f"compiled row compiled no graph on its first call (it would time eager code): {row}")
    if not compiled and row["graphs_compiled_first_call"] + row["graphs_compiled_timed"]:
        raise RuntimeError(f"eager row compiled graphs: {row}")


def measure(
    run: Callable[[], torch.Tensor], device: torch.device, warmup: int, repeats: int
) -> tuple[dict, torch.Tensor]:
    """Median seconds, peak memory and Dynamo graphs compiled of ``run``; its output (from the
    first, warm-up, call)."""
    peak = PeakMemory(device)
    peak.start()
    graphs = GraphCount()
    with torch.inference_mode():
        out = run()  # the first warm-up run: compiles when compiled
        synchronize(device)
        first = graphs.step()
        seconds, _ = median_seconds(run, device, warmup - 1, repeats)
    return {
        "seconds": seconds,
        "peak_mb": round(peak.mb(), 1),
        "graphs_compiled_first_call": first,
        "graphs_compiled_timed": graphs.step(),
    }, out


def model_rows(
    P, args, device: torch.device, variant: str, dtype_name: str, compiled: bool, compile_kwargs: dict
) -> list[dict]:
    """Every (implementation, operation) row of one variant, dtype and setting."""
    dtype = DTYPES[dtype_name]
    torch._dynamo.reset()
    models = dict(zip(IMPLEMENTATIONS, build_pair(P, variant, device, dtype)))
    ours = models["ours"]
    generator = torch.Generator().manual_seed(1)
    frames_in = torch.rand(1, args.frames, 3, args.height, args.width, generator=generator).to(device, dtype)
    scale = 8 * ours.patch_size
    latents = torch.randn(
        1,
        ours.plan(args.frames).latent_frames,
        ours.latent_channels,
        args.height // scale,
        args.width // scale,
        generator=generator,
    ).to(device, dtype)
    ops = {
        impl: operations(P, impl, models[impl], frames_in, latents, compiled, compile_kwargs)
        for impl in IMPLEMENTATIONS
    }
    setting = "compiled" if compiled else "eager"
    rows = []
    for op in OPS:
        outputs = {}
        for impl in IMPLEMENTATIONS:
            row = {"variant": variant, "dtype": dtype_name, "setting": setting, "implementation": impl, "op": op}
            out = None
            try:
                if not compiled:
                    row["compile"] = "eager"
                elif op == "stream_decode":
                    row["compile"] = stream_compile(
                        impl, models[impl], compile_kwargs, device, args.stream_compile_mode
                    )
                else:
                    row["compile"] = (
                        f"model.compile({_kwargs_text(compile_kwargs)})"
                        if impl == "ours"
                        else f"torch.compile(encode_video/decode_video, {_kwargs_text(compile_kwargs)})"
                    )
                result, out = measure(ops[impl][op], device, args.warmup, args.repeats)
                if not bool(torch.isfinite(out).all()):
                    raise RuntimeError(f"{impl} {op} ({variant}, {dtype_name}, {setting}) gave non-finite values")
                count = args.frames if op == "encode" else out.shape[1]
                row.update(
                    seconds=round(result["seconds"], 6),
                    frames_per_s=round(count / result["seconds"], 2),
                    peak_mb=result["peak_mb"],
                    output_shape=list(out.shape),
                    graphs_compiled_first_call=result["graphs_compiled_first_call"],
                    graphs_compiled_timed=result["graphs_compiled_timed"],
                )
                check_compiled(row, compiled)
                outputs[impl] = out.float().cpu()
                log(
                    f"{variant:9s} {dtype_name:5s} {setting:8s} {impl:9s} {op:13s} {row['seconds']:.4f} s "
                    f"{row['frames_per_s']:9.1f} frames/s  {row['peak_mb']:8.1f} MB"
                )
            except Exception as err:  # recorded in the row; main() exits 1 after the JSON
                record_failure(row, err)
            out = None  # the device copy goes before the next measurement
            free(device)
            rows.append(row)
        ours_row, published_row = rows[-2], rows[-1]
        if len(outputs) == 2:
            if outputs["ours"].shape != outputs["published"].shape:
                record_failure(
                    ours_row,
                    RuntimeError(
                        f"output shape {tuple(outputs['ours'].shape)} differs from the "
                        f"published model's {tuple(outputs['published'].shape)}"
                    ),
                )
            else:
                ours_row["speedup_vs_published"] = round(published_row["seconds"] / ours_row["seconds"], 3)
                ours_row["max_abs_diff_vs_published"] = float((outputs["ours"] - outputs["published"]).abs().max())
    del ops, models, ours, frames_in, latents
    torch._dynamo.reset()
    free(device)
    return rows


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
        if step.net.run_blocks is not taehv_module.run_blocks:
            how = f"config.replace(compile=True, compile_backend={config.compile_backend!r})"
        else:
            step.net.compile(**compile_kwargs)
            how = f"model.compile({_kwargs_text(compile_kwargs)}) on the step's model" + (
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


# -- main -----------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"cpu: {line.split(':', 1)[1].strip()}"
    except FileNotFoundError:  # not Linux
        pass
    return f"cpu: {platform.processor() or platform.machine()}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--variants", nargs="+", default=["taew2_1", "taehv1_5"], choices=known_variants(), metavar="VARIANT"
    )
    parser.add_argument("--frames", type=int, help="input frames (default 81; --tiny: 9)")
    parser.add_argument("--height", type=int, help="default 480; --tiny: 32")
    parser.add_argument("--width", type=int, help="default 832; --tiny: 32")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), help="default bf16 fp16; --tiny: fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="small CPU-testable run: 9 frames of 32x32, fp32, eager, 1 warm-up and 1 repeat, "
        "the smallest training clip the preset allows",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also measure compiled rows (default: on CUDA without --tiny)",
    )
    parser.add_argument("--compile_backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument(
        "--stream_compile_mode",
        default="reduce-overhead",
        choices=["reduce-overhead", "default", "max-autotune", "max-autotune-no-cudagraphs"],
        help="torch.compile mode of our compiled stream_decode on CUDA (default reduce-overhead: "
        "CUDA graphs); the published stream's blocks always use the default mode",
    )
    parser.add_argument("--warmup", type=int, help="runs before timing, the first compiles (default 3; --tiny: 1)")
    parser.add_argument("--repeats", type=int, help="timed runs, median reported (default 10; --tiny: 1)")
    parser.add_argument(
        "--model",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure ours against the published model (default on)",
    )
    parser.add_argument(
        "--train",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the 1gpu_h100 training step (default on)",
    )
    parser.add_argument(
        "--e2e",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the preset's step fed by the real loader and from the device (default on)",
    )
    parser.add_argument("--e2e_seconds", type=float, help="timed seconds per end-to-end row (default 60; --tiny: 1)")
    parser.add_argument(
        "--e2e_clips", type=int, help="clips per epoch of the end-to-end rows (default 256; --tiny: 32)"
    )
    parser.add_argument("--workers", type=int, help="loader workers (default: the preset's; --tiny: 1)")
    parser.add_argument(
        "--videos_dir", type=Path, default=shared_dir() / "videos", help="clips for the end-to-end rows, re-encoded"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--published", type=Path, default=PUBLISHED_PATH, help="the published taehv.py")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    defaults = dict(
        frames=(9, 81),
        height=(32, 480),
        width=(32, 832),
        dtypes=(["fp32"], ["bf16", "fp16"]),
        warmup=(1, 3),
        repeats=(1, 10),
        e2e_seconds=(1.0, 60.0),
        e2e_clips=(32, 256),
        workers=(1, None),  # None: the preset's dataloader_num_workers
    )
    for name, (tiny, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    if args.compile is None:
        args.compile = args.device.startswith("cuda") and not args.tiny
    backends = torch._dynamo.list_backends(exclude_tags=())
    if args.compile_backend not in backends:
        parser.error(f"--compile_backend {args.compile_backend!r}: not one of {', '.join(backends)}")
    if args.warmup < 1 or args.repeats < 1:
        parser.error("--warmup and --repeats must be >= 1")
    if args.e2e_seconds <= 0 or args.e2e_clips < 1 or (args.workers or 0) < 0:
        parser.error("--e2e_seconds and --e2e_clips must be positive, --workers >= 0")
    for variant in args.variants:
        try:
            check_variant(variant)
        except ValueError as err:
            parser.error(str(err))
        multiple = 8 * get_variant(variant).patch_size
        if args.height % multiple or args.width % multiple:
            parser.error(f"{variant}: height and width must be multiples of {multiple}, got {args.height}x{args.width}")
    return args


def main() -> None:
    args = parse_args()
    with contextlib.redirect_stdout(sys.stderr):  # libraries' log lines stay out of the JSON
        result = run(args)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    failed = [row for row in result["model"] + result["train_step"] + result["end_to_end"] if "error" in row]
    if failed:
        log(f"{len(failed)} measurement(s) failed (their rows have an 'error' field):")
        for row in failed:
            keys = ("variant", "dtype", "feed", "setting", "implementation", "op")
            where = {k: v for k, v in row.items() if k in keys}
            log(f"  {json.dumps(where)}: {row['error'][:300]}")
        sys.exit(1)


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    compile_kwargs = {
        "dynamic": False,
        **({} if args.compile_backend == "inductor" else {"backend": args.compile_backend}),
    }
    settings = [False, True] if args.compile else [False]
    started = time.perf_counter()
    rows = []
    if args.model:
        P = load_published(args.published)
        for variant, dtype_name, compiled in itertools.product(args.variants, args.dtypes, settings):
            rows += model_rows(P, args, device, variant, dtype_name, compiled, compile_kwargs)
    train_setup, train = training_rows(args, device, settings, compile_kwargs) if args.train else (None, [])
    e2e_setup, e2e = end_to_end_rows(args, device) if args.e2e else (None, [])
    return {
        "benchmark": "gpu_path",
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": {
            "variants": args.variants,
            "frames": args.frames,
            "height": args.height,
            "width": args.width,
            "dtypes": args.dtypes,
            "tiny": args.tiny,
            "compile": args.compile,
            "compile_backend": args.compile_backend,
            "stream_compile_mode": args.stream_compile_mode,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "model": args.model,
            "train": args.train,
            "e2e": args.e2e,
            "e2e_seconds": args.e2e_seconds,
            "e2e_clips": args.e2e_clips,
            "workers": args.workers,
            "videos_dir": str(args.videos_dir),
            "threads": torch.get_num_threads(),
            "cudnn_benchmark": device.type == "cuda",
            "ours_memory_format": "channels_last",
            "published_memory_format": "contiguous",
            "published": str(args.published),
            "peak_memory": (
                "torch.cuda.max_memory_allocated above memory_allocated before the first run"
                if device.type == "cuda"
                else cpu_peak_method()
            ),
        },
        "model": rows,
        "train_step_setup": train_setup,
        "train_step": train,
        "end_to_end_setup": e2e_setup,
        "end_to_end": e2e,
        "total_s": round(time.perf_counter() - started, 1),
    }


if __name__ == "__main__":
    main()
