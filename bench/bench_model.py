#!/usr/bin/env python3
"""Encode/decode latency and peak memory of TAEHV; prints one JSON object.

    python bench/bench_model.py --frames 9 17 --height 128 --width 128
    python bench/bench_model.py --device cuda --dtype bfloat16 --frames 17 49 --height 480 --width 720

Each configuration runs in a fresh process, so CPU peak memory (max RSS growth over the
loaded model and inputs) is not polluted by earlier runs; on CUDA the peak is
``torch.cuda.max_memory_allocated`` above the inputs. Timings are medians over
``--repeats`` runs after ``--warmup`` runs, synchronised on CUDA, under inference_mode.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.taehv import TAEHV  # noqa: E402
from training.monitoring import peak_rss_bytes  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_bytes() / 2**20


def _timed(fn, device: torch.device, warmup: int, repeats: int) -> tuple[float, torch.Tensor]:
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def measure(config: dict) -> dict:
    """One configuration and operation ("encode" or "decode"): latency and peak memory."""
    if config["threads"]:
        torch.set_num_threads(config["threads"])
    device, dtype = torch.device(config["device"]), DTYPES[config["dtype"]]
    parallel = config["mode"] == "parallel"
    torch.manual_seed(0)
    model = TAEHV(variant=config["variant"]).to(device, dtype).eval()
    if config["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    plan = model.plan(config["frames"])
    if config["op"] == "encode":
        inputs = torch.rand(1, config["frames"], 3, config["height"], config["width"], device=device, dtype=dtype)
        run = lambda: model.encode_video(inputs, parallel=parallel)  # noqa: E731
    else:
        h, w = config["height"] // (8 * model.patch_size), config["width"] // (8 * model.patch_size)
        inputs = torch.randn(1, plan.latent_frames, model.latent_channels, h, w, device=device, dtype=dtype)
        run = lambda: model.decode_video(inputs, parallel=parallel)  # noqa: E731
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        base = _peak_mb(device)
        seconds, out = _timed(run, device, config["warmup"], config["repeats"])
        peak = _peak_mb(device) - base
    return {"seconds": seconds, "peak_mb": peak, "output_shape": list(out.shape)}


def _run_isolated(config: dict) -> dict:
    """Encode and decode, each measured in a fresh process (CPU peak RSS is a high-water mark)."""
    result = dict(config)
    for op in ("encode", "decode"):
        with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
            r = pool.submit(measure, {**config, "op": op}).result()
            result[f"{op}_s"], result[f"{op}_peak_mb"], result[f"{op}_output_shape"] = r["seconds"], r["peak_mb"], r["output_shape"]
    result["decode_frames_per_s"] = result["decode_output_shape"][1] / result["decode_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, nargs="+", default=[9, 17])
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--modes", nargs="+", choices=["parallel", "sequential"], default=["parallel", "sequential"])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["float32"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variant", default="taehv")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    runs = []
    for dtype in args.dtypes:
        for mode in args.modes:
            for frames in args.frames:
                config = dict(
                    frames=frames, height=args.height, width=args.width, mode=mode, dtype=dtype, device=args.device,
                    variant=args.variant, channels_last=args.channels_last, threads=args.threads,
                    warmup=args.warmup, repeats=args.repeats,
                )
                runs.append(_run_isolated(config))
                r = runs[-1]
                print(f"{mode:10s} {dtype:8s} T={frames:3d}: encode {r['encode_s']:.3f}s ({r['encode_peak_mb']:.0f} MB) "
                      f"decode {r['decode_s']:.3f}s ({r['decode_peak_mb']:.0f} MB)", file=sys.stderr)
    machine = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
               "threads": torch.get_num_threads(), "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    print(json.dumps({"benchmark": "model", "machine": machine, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
