#!/usr/bin/env python3
"""The GPU path in one command: our TAEHV against the published implementation, eager and
compiled, in bf16 and fp16, and the 1gpu_h100 preset trained by the command users type
against the same training engine fed from the device; prints JSON.

    make bench-gpu ARGS="--videos_dir DIR"             # everything below, on the GPU
    python -m bench.bench_gpu --videos_dir DIR         # the same
    python -m bench.bench_gpu --variants taehv1_5 --dtypes bf16 --frames 49 --no-e2e --out gpu.json
    python -m bench.bench_gpu --no-model --videos_dir DIR --out e2e.json   # only the end-to-end rows
    python -m bench.bench_gpu --tiny --videos_dir DIR  # CPU: 9 frames of 32x32, fp32, eager; seconds per row

Model rows, for each variant (``--variants``, default taew2_1 taehv1_5), dtype (``--dtypes``,
default bf16 fp16) and setting (eager; compiled unless ``--no_compile``), and for each
implementation (``ours``: models/taehv.py, cast with ``.to(device, dtype)`` and
``.to(memory_format=torch.channels_last)``; ``published``: the published taehv.py in
../shared/reference (``$TAEHV_SHARED_DIR/reference``, ``--published``), built with the
same architecture, loaded with our weights and cast with ``.to(device, dtype)`` as its
own main() does), three operations on the same inputs, with cuDNN's benchmark mode on:

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

End-to-end rows (bench/lib/gpu_training.py), each in its own processes and bounded in time
(``--row_timeout``; a row that runs past it is killed with every process it started and
gets an ``error`` field): the clips of ``--videos_dir`` (required: a missing or empty folder
is a one-line error, exit status 2, before anything runs), the first 8 by name and at most
300 frames of each, re-encoded to 720x480 H.264 with a keyframe every 30 frames
(bench/lib/reencoded_clips.py), listed over and over in an annotation of ``--e2e_clips``
entries (one epoch). Two feeds: ``plain`` (no reference
latents, ``--ref_vae_path=``) and ``cached`` (reference latents from the latent cache that
``python -m taehv_train.training.build_latent_cache`` builds for those clips with a random-weight
CogVideoX VAE, ``--cache_vae``: none can be downloaded on a benchmark machine; the cached
step never runs the VAE). Each feed has two rows:

- ``on_device`` (the ceiling): bench/lib/on_device_step.py, started with ``python -m
  taehv_train.training.launch`` as the launch script starts one training process (on CUDA with
  accelerate_configs/deepspeed_1gpu.yaml: DeepSpeed ZeRO-2, bf16 weights; on a CPU a
  one-process DeepSpeed ZeRO-2 run on gloo), the preset's step built as training builds it
  (``make_accelerator``, ``TrainStep.build``, the loader pinned on CUDA, cuDNN's benchmark
  mode off, ``compile`` as the preset says), fed the loader's first window of batches kept
  on the device and cycled: ``--warmup`` windows, then windows for ``--e2e_seconds``;
- ``launch_script``: ``./train_taehv_h100.sh 1 1gpu_h100`` with the clips
  (``--data_root``, ``--annotation_file``, no validation set), from scratch
  (``--pretrained_model_path=``), the feed's ``--ref_vae_path`` (and ``--latent_cache_dir``),
  a fresh ``--output_dir``, ``--max_train_time`` of ``--e2e_run_time`` seconds (start-up and
  compilation included; ``--tiny``: ``--max_train_steps=3``), ``--validations_per_budget=0``
  (no validation set to spread) and ``--log_every`` 10 (the preset's 50 leaves few log steps
  in minutes); its figures are read from the TensorBoard scalars the run writes
  (``train/samples_per_second``, ``train/data_wait``, ``train/gpu_idle``, ``train/tflops``,
  ``train/mfu``, ``train/gpu_memory_gb``) over the log steps after its first 20 steps
  (compilation, warm-up), each weighted by its seconds, with the run's last log line.

Both give clips/s, frames/s, the TAE's training TFLOP/s and MFU (null for a GPU of unknown
peak), ``data_wait`` and ``gpu_idle`` as shares of the wall time (``gpu_idle`` null on a
CPU) and the command that ran; the launch script's row its ``ratio_to_on_device``.
``--tiny``: two 30-frame clips at 96x64, the smallest clip the preset trains on (9 frames
of 8x8) in windows of 2 micro-batches, no mixed precision, a tiny CogVideoX VAE, 32 clips
per epoch, 1 worker, 1 s per on-device row.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.lib.gpu_measure import (
    GraphCount,
    PeakMemory,
    check_compiled,
    cpu_peak_method,
    device_name,
    free,
    kwargs_text,
    log,
    record_failure,
)
from bench.lib.gpu_training import CACHE_VAES, Plan, VideosError, check_videos_dir, end_to_end_rows, user_error
from bench.lib.harness import command_line, load_published, print_json, published_file, utc_now
from taehv_train.base.flags import ArgumentParser
from taehv_train.common.config import DTYPES
from taehv_train.evaluation.timing import median_seconds, synchronize
from taehv_train.models.taehv import TAEHV
from taehv_train.models.variants import get_variant, known_variants

PUBLISHED_PATH = published_file("taew2_1")
OPS = ("encode", "decode", "stream_decode")
IMPLEMENTATIONS = ("ours", "published")


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
        return f"model.compile({kwargs_text(kwargs)})"
    for block in model.decoder:
        block.compile(**compile_kwargs)
    return f"each decoder block .compile({kwargs_text(compile_kwargs)})"


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
                        f"model.compile({kwargs_text(compile_kwargs)})"
                        if impl == "ours"
                        else f"torch.compile(encode_video/decode_video, {kwargs_text(compile_kwargs)})"
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
                # three significant digits: a ratio far below 1 keeps its precision
                ours_row["speedup_vs_published"] = float(f"{published_row['seconds'] / ours_row['seconds']:.3g}")
                ours_row["max_abs_diff_vs_published"] = float((outputs["ours"] - outputs["published"]).abs().max())
    del ops, models, ours, frames_in, latents
    torch._dynamo.reset()
    free(device)
    return rows


# -- main -----------------------------------------------------------------------------------


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
        "--e2e",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the preset trained by the launch script and the same engine fed from the device (default on)",
    )
    parser.add_argument(
        "--videos_dir", type=Path, help="clips for the end-to-end rows, re-encoded to 720x480 (required with them)"
    )
    parser.add_argument("--e2e_seconds", type=float, help="timed seconds of an on-device row (default 60; --tiny: 1)")
    parser.add_argument(
        "--e2e_run_time",
        type=float,
        help="seconds of a launch-script run, its --max_train_time, start-up and compilation included (default 150)",
    )
    parser.add_argument(
        "--e2e_clips", type=int, help="clips per epoch of the end-to-end rows (default 256; --tiny: 32)"
    )
    parser.add_argument("--workers", type=int, help="loader workers (default: the preset's; --tiny: 1)")
    parser.add_argument(
        "--cache_vae",
        choices=sorted(CACHE_VAES),
        help="the random-weight VAE the latent cache is built with (default cogvideox-2b; --tiny: tiny)",
    )
    parser.add_argument(
        "--row_timeout",
        type=float,
        help="seconds an end-to-end row (or the cache build) may run before it is killed (default 600; --tiny: 240)",
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
        cache_vae=("tiny", "cogvideox-2b"),
        row_timeout=(240.0, 600.0),
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
    if args.e2e_seconds <= 0 or args.e2e_clips < 1 or (args.workers or 0) < 0 or args.row_timeout <= 0:
        parser.error("--e2e_seconds, --e2e_clips and --row_timeout must be positive, --workers >= 0")
    for variant in args.variants:
        try:
            check_variant(variant)
        except ValueError as err:
            parser.error(str(err))
        multiple = 8 * get_variant(variant).patch_size
        if args.height % multiple or args.width % multiple:
            parser.error(f"{variant}: height and width must be multiples of {multiple}, got {args.height}x{args.width}")
    return args


def e2e_plan(args: argparse.Namespace) -> Plan:
    """The end-to-end rows' plan from the command line."""
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    plan = Plan.tiny_plan(args.videos_dir, device) if args.tiny else Plan(args.videos_dir, device)
    plan.clips_per_epoch, plan.on_device_seconds, plan.cache_vae = args.e2e_clips, args.e2e_seconds, args.cache_vae
    plan.compile_backend, plan.warmup_windows = args.compile_backend, args.warmup
    if args.workers is not None:
        plan.workers = args.workers
    if args.e2e_run_time is not None:
        plan.run_time_s = args.e2e_run_time
    plan.timeouts = dict.fromkeys(plan.timeouts, args.row_timeout)
    return plan


def main() -> None:
    args = parse_args()
    if args.e2e:
        try:
            check_videos_dir(args.videos_dir)
        except VideosError as err:
            user_error(str(err))
    with contextlib.redirect_stdout(sys.stderr):  # libraries' log lines stay out of the JSON
        result = run(args)
    print_json(result, out=args.out)
    failed = [row for row in result["model"] + result["end_to_end"] if "error" in row]
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
    compile_kwargs = {
        "dynamic": False,
        **({} if args.compile_backend == "inductor" else {"backend": args.compile_backend}),
    }
    settings = [False, True] if args.compile else [False]
    started = time.perf_counter()
    rows = []
    if args.model:
        P = load_published(args.published)
        with cudnn_benchmark(device.type == "cuda"):  # the model rows only: training leaves it off
            for variant, dtype_name, compiled in itertools.product(args.variants, args.dtypes, settings):
                rows += model_rows(P, args, device, variant, dtype_name, compiled, compile_kwargs)
    e2e_setup, e2e = None, []
    if args.e2e:
        with tempfile.TemporaryDirectory(prefix="bench_gpu_e2e_") as folder:
            e2e_setup, e2e = end_to_end_rows(e2e_plan(args), Path(folder))
    return {
        "benchmark": "gpu_path",
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": utc_now(),
        "command": command_line(),
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
            "e2e": args.e2e,
            "videos_dir": None if args.videos_dir is None else str(args.videos_dir),
            "threads": torch.get_num_threads(),
            "model_rows_cudnn_benchmark": device.type == "cuda",
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
        "end_to_end_setup": e2e_setup,
        "end_to_end": e2e,
        "total_s": round(time.perf_counter() - started, 1),
    }


@contextlib.contextmanager
def cudnn_benchmark(enabled: bool):
    """cuDNN's benchmark mode set to ``enabled`` inside."""
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous


if __name__ == "__main__":
    main()
