#!/usr/bin/env python3
"""What ``torch.compile`` (``TAEHV.compile``, training's ``compile=true``) costs and gains
on this machine: compilation time and steady-state time, eager against compiled; prints
one JSON object.

    python -m bench.bench_compile                                # taehv, 9x128x128 inference, 9x64x64 training step
    python -m bench.bench_compile --frames 5 --height 16 --width 16 --train_height 16 --train_width 16 \\
        --backend aot_eager --repeats 1                          # seconds: checks the script, measures nothing useful

Cases (``--cases``), each measured eager and compiled, each in a fresh process (so every
compiled row pays dynamo's and the backend's first imports as a user's process does):

- ``parallel`` / ``sequential``: ``encode_video`` of a (1, T, 3, H, W) clip in [0, 1], then
  ``decode_video`` of its latents, under ``torch.inference_mode`` with channels-last
  weights, as ``inference.py`` runs them. Sequential mode compiles two graphs per block
  sequence (the first chunk, with empty memory, and the others).
- ``train``: the product's training step (``training.loop.step.TrainStep``, built as the loop
  builds it) on one in-memory batch with reference latents, as the latent cache delivers
  them: forward, losses, backward, clipping, AdamW and EMA steps.

``first_s`` is the first call (compilation included), ``steady_s`` the median of
``--repeats`` calls after ``--warmup`` more; ``compile_s`` = first - steady. Compiled rows
give ``speedup`` (eager steady over compiled steady) and ``max_abs_diff`` (their output
against the eager row's: latents, frames, or the first step's loss). Inductor's on-disk
caches start empty in every process unless ``--warm_cache`` (then a second run measures
what a later launch pays). Timings are synchronised on CUDA.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import torch

from bench.lib.harness import command_line, device_label, print_json
from taehv_train.base.flags import ArgumentParser
from taehv_train.evaluation.timing import median_seconds, timed
from taehv_train.models.taehv import TAEHV

CASES = ("parallel", "sequential", "train")


def first_and_steady(
    fn: Callable[[], object], device: torch.device, warmup: int, repeats: int, compiled: bool
) -> tuple[dict, object]:
    """Timings (the first call, the median of ``repeats`` after ``warmup`` more, and for a
    compiled model their difference) and the first call's output."""
    out, first, _ = timed(fn, device)
    steady, _ = median_seconds(fn, device, warmup, repeats)
    timing = {"first_s": round(first, 4), "steady_s": round(steady, 4)}
    if compiled:
        timing["compile_s"] = round(first - steady, 4)
    return timing, out


def inference_case(config: dict, device: torch.device) -> dict:
    """Encode, then decode, of one clip; the model as ``inference.py`` sets it up."""
    torch.manual_seed(0)
    model = TAEHV(variant=config["variant"]).to(device).eval()
    if config["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    if config["compiled"]:
        model.compile(backend=config["backend"])
    parallel = config["case"] == "parallel"
    frames = torch.rand(1, config["frames"], 3, config["height"], config["width"], device=device)
    counts = {"warmup": config["warmup"], "repeats": config["repeats"], "compiled": config["compiled"]}
    with torch.inference_mode():
        encode, latents = first_and_steady(lambda: model.encode_video(frames, parallel=parallel), device, **counts)
        decode, decoded = first_and_steady(lambda: model.decode_video(latents, parallel=parallel), device, **counts)
    return {"encode": encode, "decode": decode, "outputs": {"encode": latents.cpu(), "decode": decoded.cpu()}}


def train_case(config: dict, device: torch.device) -> dict:
    """First and steady steps of ``TrainStep`` with cached reference latents."""
    from bench.lib.step_builder import train_step
    from taehv_train.common.config import TrainConfig
    from taehv_train.training.data.loading import ReferenceLatents

    size = (config["train_height"], config["train_width"])
    train_config = TrainConfig(
        variant=config["variant"],
        n_frames=config["frames"],
        height=size[0],
        width=size[1],
        train_batch_size=config["batch"],
        mixed_precision=config["mixed_precision"],
        learning_rate=1e-4,
        compile=config["compiled"],
        compile_backend=config["backend"],
    )
    torch.manual_seed(0)
    step = train_step(train_config, device, ReferenceLatents(None, cached=True), seraena=False)
    torch.manual_seed(1)
    frames = torch.randint(0, 256, (config["batch"], config["frames"], 3, *size), dtype=torch.uint8)
    scale = 8 * step.unwrapped_model.patch_size
    latents = torch.randn(
        config["batch"],
        step.unwrapped_model.plan(config["frames"]).latent_frames,
        step.unwrapped_model.latent_channels,
        size[0] // scale,
        size[1] // scale,
        device=device,
    )
    batch = {"frames": frames, "latents": latents}
    windows = iter(range(1, 1 << 30))
    timing, first = first_and_steady(
        lambda: step(iter([batch]), next(windows)), device, config["warmup"], config["repeats"], config["compiled"]
    )
    return {"step": timing, "outputs": {"step": first.losses[0]["loss"].cpu()}}  # the first step's loss


def measure(config: dict) -> dict:
    """One case, eager or compiled, in this (fresh) process."""
    if config["threads"]:
        torch.set_num_threads(config["threads"])
    device = torch.device(config["device"])
    case = train_case if config["case"] == "train" else inference_case
    if not config["compiled"] or config["warm_cache"]:
        return case(config, device)
    with tempfile.TemporaryDirectory(prefix="bench_compile_inductor_") as cache:  # a cold cache, removed after
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # inductor reads it when it first compiles
        return case(config, device)


def run_isolated(config: dict) -> dict:
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(measure, config).result()


def compare(eager: dict, compiled: dict) -> None:
    """Speed-up and output difference of a compiled row against its eager row (in place)."""
    for name, out in compiled.pop("outputs").items():
        timing = compiled[name]
        timing["speedup"] = round(eager[name]["steady_s"] / timing["steady_s"], 3)
        timing["max_abs_diff"] = float((out.float() - eager["outputs"][name].float()).abs().max())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variant", default="taehv")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: tracing only)")
    parser.add_argument(
        "--frames", type=int, default=9, help="frames of the clip (inference) and of each training clip"
    )
    parser.add_argument("--height", type=int, default=128, help="inference clip size")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--train_height", type=int, default=64, help="training clip size")
    parser.add_argument("--train_width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="training batch")
    parser.add_argument(
        "--mixed_precision", default=None, help="training: no | bf16 (default: bf16 on CUDA, no on CPU)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="calls after the first, before the timed ones")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument(
        "--no_channels_last",
        dest="channels_last",
        action="store_false",
        help="inference without channels-last weights (inference.py's default has them)",
    )
    parser.add_argument("--warm_cache", action="store_true", help="use inductor's default on-disk caches")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    precision = args.mixed_precision or ("bf16" if device.type == "cuda" else "no")
    common = {
        "device": args.device,
        "variant": args.variant,
        "backend": args.backend,
        "frames": args.frames,
        "height": args.height,
        "width": args.width,
        "train_height": args.train_height,
        "train_width": args.train_width,
        "batch": args.batch,
        "mixed_precision": precision,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "threads": args.threads,
        "channels_last": args.channels_last,
        "warm_cache": args.warm_cache,
    }
    rows = []
    for case in args.cases:
        eager = run_isolated({**common, "case": case, "compiled": False})
        compiled = run_isolated({**common, "case": case, "compiled": True})
        compare(eager, compiled)
        eager.pop("outputs")
        rows.append({"case": case, "eager": eager, "compiled": compiled})
        print(
            f"{case}: "
            + ", ".join(
                f"{name} {eager[name]['steady_s']:.3f}s eager, {t['steady_s']:.3f}s compiled "
                f"(+{t['compile_s']:.1f}s compiling)"
                for name, t in compiled.items()
            ),
            file=sys.stderr,
        )
    return {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {os.cpu_count()} cores",
        "device": device_label(device),
        "torch": torch.__version__,
        "command": command_line(),
        "threads": args.threads or torch.get_num_threads(),
        **{k: v for k, v in common.items() if k not in ("device", "threads")},
        "inductor_cache": "default" if args.warm_cache else "fresh per process",
        "rows": rows,
    }


if __name__ == "__main__":
    print_json(main())
