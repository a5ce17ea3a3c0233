#!/usr/bin/env python3
"""Encode/decode latency and peak memory of TAEHV next to the CogVideoX-2b VAE; prints JSON.

    python -m bench.bench_model --frames 9 17 49 --height 128 --width 128
    python -m bench.bench_model --frames 9 --height 256 --width 256 --dtypes fp32 bf16
    python -m bench.bench_model --device cuda --dtypes bf16 --frames 17 49 --height 480 --width 720

For each (dtype, T) the reference, diffusers ``AutoencoderKLCogVideoX`` with the
CogVideoX-2b architecture (random weights: speed does not depend on them), is measured
by the same harness with the same threads, and every TAEHV row (parallel and sequential)
carries ``decode_speedup`` / ``encode_speedup`` (reference seconds over ours) and
``decode_memory_saving`` (1 - our peak / the reference's peak). ``--reference none``
skips it; ``--ref_repeats`` (default 1: a 9x128x128 reference decode takes 17-40 s on a
2-core CPU) sets its repetitions.

Each measurement (model x operation) runs in a fresh process, so CPU peak memory (max RSS
growth over the loaded model and inputs) is not polluted by earlier runs; on CUDA the
peak is ``torch.cuda.max_memory_allocated`` above the inputs. Timings are medians over
``--repeats`` runs after ``--warmup`` runs, synchronised on CUDA, under inference_mode.
Inputs: TAEHV gets NTCHW frames in [0, 1] (encode) or random latents of its latent shape;
the reference gets NCTHW frames in [-1, 1] or random latents of its own latent shape.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import torch

from bench.lib.harness import cpu_name, cuda_name, print_json
from taehv_train.base.flags import ArgumentParser
from taehv_train.common.config import DTYPES
from taehv_train.evaluation.timing import median_seconds
from taehv_train.models.taehv import TAEHV
from taehv_train.training.loop.monitoring import peak_rss_bytes
from tools.make_reference_vae import COGVIDEOX_2B


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_bytes() / 2**20


def _taehv_operation(config: dict, device: torch.device, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    torch.manual_seed(0)
    model = TAEHV(variant=config["variant"]).to(device, dtype).eval()
    memory_format = torch.channels_last if config["channels_last"] else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    parallel = config["mode"] == "parallel"
    if config["compile"]:
        model.compile()
    encode_fn, decode_fn = model.encode_video, model.decode_video
    if config["op"] == "encode":
        frames = torch.rand(1, config["frames"], 3, config["height"], config["width"], device=device, dtype=dtype)
        return lambda: encode_fn(frames, parallel=parallel)
    scale = 8 * model.patch_size
    latents = torch.randn(
        1,
        model.plan(config["frames"]).latent_frames,
        model.latent_channels,
        config["height"] // scale,
        config["width"] // scale,
        device=device,
        dtype=dtype,
    )
    return lambda: decode_fn(latents, parallel=parallel)


def _reference_operation(config: dict, device: torch.device, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    from diffusers import AutoencoderKLCogVideoX

    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(**COGVIDEOX_2B).to(device, dtype).eval()
    if config["op"] == "encode":
        frames = (
            torch.rand(1, 3, config["frames"], config["height"], config["width"], device=device, dtype=dtype) * 2 - 1
        )
        return lambda: vae.encode(frames).latent_dist.mode()
    t = (config["frames"] - 1) // vae.config.temporal_compression_ratio + 1  # CogVideoX: 1 + 4k frames
    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    latents = torch.randn(
        1,
        vae.config.latent_channels,
        t,
        config["height"] // scale,
        config["width"] // scale,
        device=device,
        dtype=dtype,
    )
    return lambda: vae.decode(latents).sample


def measure(config: dict) -> dict:
    """One model ("taehv" or "cogvideox-2b") and operation ("encode"/"decode"): latency, peak memory."""
    if config["threads"]:
        torch.set_num_threads(config["threads"])
    device, dtype = torch.device(config["device"]), DTYPES[config["dtype"]]
    build = _reference_operation if config["model"] == "cogvideox-2b" else _taehv_operation
    run = build(config, device, dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        base = _peak_mb(device)
        seconds, out = median_seconds(run, device, config["warmup"], config["repeats"])
        peak = _peak_mb(device) - base
    return {"seconds": seconds, "peak_mb": peak, "output_shape": list(out.shape)}


def run_isolated(config: dict) -> dict:
    """Encode and decode, each measured in a fresh process (CPU peak RSS is a high-water mark)."""
    result = dict(config)
    for op in ("encode", "decode"):
        with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
            r = pool.submit(measure, {**config, "op": op}).result()
        result[f"{op}_s"], result[f"{op}_peak_mb"], result[f"{op}_output_shape"] = (
            r["seconds"],
            r["peak_mb"],
            r["output_shape"],
        )
    return result


def add_ratios(row: dict, reference: dict) -> None:
    """Speed-ups and memory saving of a TAEHV row against the reference row of the same shape."""
    for op in ("encode", "decode"):
        row[f"{op}_speedup"] = round(reference[f"{op}_s"] / row[f"{op}_s"], 2)
        row[f"{op}_memory_saving"] = round(1 - row[f"{op}_peak_mb"] / reference[f"{op}_peak_mb"], 3)


def _log(row: dict) -> None:
    label = row["model"] if row["model"] != "taehv" else f"taehv {row['mode']}"
    ratio = f" x{row['decode_speedup']} decode" if "decode_speedup" in row else ""
    print(
        f"{label:18s} {row['dtype']:8s} T={row['frames']:3d} {row['height']}x{row['width']}: "
        f"encode {row['encode_s']:.3f}s ({row['encode_peak_mb']:.0f} MB) "
        f"decode {row['decode_s']:.3f}s ({row['decode_peak_mb']:.0f} MB){ratio}",
        file=sys.stderr,
        flush=True,
    )


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, nargs="+", default=[9, 17])
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--modes", nargs="+", choices=["parallel", "sequential"], default=["parallel", "sequential"])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["fp32"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variant", default="taecvx", help="TAEHV variant (taecvx: CogVideoX latents)")
    parser.add_argument("--reference", choices=["cogvideox-2b", "none"], default="cogvideox-2b")
    parser.add_argument("--channels_last", action="store_true")
    parser.add_argument(
        "--compile", action="store_true", help="TAEHV.compile(): torch.compile the block runner behind encode/decode"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ref_warmup", type=int, default=0)
    parser.add_argument("--ref_repeats", type=int, default=1)
    args = parser.parse_args()

    common = dict(
        height=args.height,
        width=args.width,
        device=args.device,
        threads=args.threads,
        variant=args.variant,
        channels_last=args.channels_last,
        compile=args.compile,
    )
    runs = []
    for dtype in args.dtypes:
        for frames in args.frames:
            reference = None
            if args.reference != "none":
                reference = run_isolated(
                    {
                        **common,
                        "model": args.reference,
                        "mode": "reference",
                        "frames": frames,
                        "dtype": dtype,
                        "warmup": args.ref_warmup,
                        "repeats": args.ref_repeats,
                    }
                )
                runs.append(reference)
                _log(reference)
            for mode in args.modes:
                row = run_isolated(
                    {
                        **common,
                        "model": "taehv",
                        "mode": mode,
                        "frames": frames,
                        "dtype": dtype,
                        "warmup": args.warmup,
                        "repeats": args.repeats,
                    }
                )
                if reference is not None:
                    add_ratios(row, reference)
                runs.append(row)
                _log(row)
    machine = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "cuda": cuda_name(),
    }
    print_json({"benchmark": "model", "machine": machine, "runs": runs}, indent=2)


if __name__ == "__main__":
    main()
