#!/usr/bin/env python3
"""The GPU path in one command: our TAEHV against the published implementation, eager and
compiled, in bf16 and fp16, plus a training step of the 1gpu_h100 preset; prints JSON.

    make bench-gpu                                      # the defaults below, on the GPU
    python -m bench.bench_gpu                           # the same
    python -m bench.bench_gpu --variants taehv1_5 --dtypes bf16 --frames 49 --out gpu.json
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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch._dynamo.utils import counters

REPO_ROOT = Path(__file__).resolve().parents[1]
from bench.bench_speed import load_published, published_file
from bench.bench_train_step import train_step
from common.config import DTYPES, TrainConfig, load_config
from common.flags import ArgumentParser
from evaluation.timing import median_seconds, synchronize
from models import taehv as taehv_module
from models.taehv import TAEHV
from models.vae_registry import reference_vae_frames
from models.variants import get_variant, known_variants
from training.data.loading import ReferenceLatents
from training.loop.monitoring import peak_rss_bytes

PUBLISHED_PATH = published_file("taew2_1")
PRESET = REPO_ROOT / "training" / "configs" / "taehv_config_1gpu_h100.py"
OPS = ("encode", "decode", "stream_decode")
IMPLEMENTATIONS = ("ours", "published")
CLEAR_REFS = Path("/proc/self/clear_refs")


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


def training_config(args, device: torch.device) -> TrainConfig:
    """The 1gpu_h100 preset, or on ``--tiny`` the smallest clip it allows (and no mixed precision)."""
    config = load_config(PRESET)
    if args.tiny:
        spec = get_variant(config.variant)
        frames = [t for t in spec.exact_frame_counts(64) if reference_vae_frames(t, spec)][0]
        side = 8 * spec.patch_size
        config = config.replace(n_frames=frames, height=side, width=side, mixed_precision="no")
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
        if step.net.run_chunk is not taehv_module.run_chunk:
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
        "--train",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the 1gpu_h100 training step (default on)",
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
    failed = [row for row in result["model"] + result["train_step"] if "error" in row]
    if failed:
        log(f"{len(failed)} measurement(s) failed (their rows have an 'error' field):")
        for row in failed:
            where = {k: v for k, v in row.items() if k in ("variant", "dtype", "setting", "implementation", "op")}
            log(f"  {json.dumps(where)}: {row['error'][:300]}")
        sys.exit(1)


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    P = load_published(args.published)
    compile_kwargs = {
        "dynamic": False,
        **({} if args.compile_backend == "inductor" else {"backend": args.compile_backend}),
    }
    settings = [False, True] if args.compile else [False]
    started = time.perf_counter()
    rows = []
    for variant in args.variants:
        for dtype_name in args.dtypes:
            for compiled in settings:
                rows += model_rows(P, args, device, variant, dtype_name, compiled, compile_kwargs)
    train_setup, train = training_rows(args, device, settings, compile_kwargs) if args.train else (None, [])
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
        "total_s": round(time.perf_counter() - started, 1),
    }


if __name__ == "__main__":
    main()
