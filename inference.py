#!/usr/bin/env python3
"""Evaluate a TAEHV: aligned PSNR/SSIM/MSE (LPIPS when installed), temporal error, speed and
memory, optionally next to the reference VAE; writes metrics.json, comparison videos,
latent pictures and summary_report.html.

    python inference.py --model_path output/<run>/final_model.safetensors --config training/configs/taehv_config_demo.py
    python inference.py --model_path checkpoints/taecvx.pth --videos clip1.mp4 clip2.mp4 --use_ref_vae \
        --ref_vae_path checkpoints/CogVideoX-2b --num_samples 50 --output_dir results
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from evaluation.report import write_report  # noqa: E402
from evaluation.stills import comparison_stills  # noqa: E402
from evaluation.videos import latent_picture, side_by_side, to_uint8_frames, write_video  # noqa: E402
from models.checkpoint import find_weights  # noqa: E402
from models.taehv import TAEHV  # noqa: E402
from training.config import DTYPES, REF_VAE_CLASSES, TrainConfig, load_config, resolve_path  # noqa: E402
from training.dataset import VideoClipDataset, find_videos, frames_to_unit, probe_video  # noqa: E402
from training.errors import exit_on_config_error  # noqa: E402
from training.metrics import (  # noqa: E402
    frame_psnr, lpips_unavailable_reason, video_lpips, video_mse, video_psnr, video_ssim, video_temporal_error)
from training.reference_vae import ReferenceVAE  # noqa: E402

logger = logging.getLogger("inference")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_path", required=True,
                   help="weights (.pth/.safetensors, ours or published), a training checkpoint or best_model folder, "
                        "or a run folder")
    p.add_argument("--variant", default=None, help="architecture when the file does not say (e.g. taecvx)")
    p.add_argument("--config", default=None, help="training config: default data (val set), size and frames")
    src = p.add_argument_group("data (one of --videos, --annotation_file/--data_root, --config)")
    src.add_argument("--videos", nargs="+", default=None, help="video files or folders")
    src.add_argument("--data_root", default=None)
    src.add_argument("--annotation_file", default=None)
    p.add_argument("--num_samples", type=int, default=10)
    p.add_argument("--n_frames", type=int, default=None, help="frames per sample (default: config or 17)")
    p.add_argument("--height", type=int, default=None,
                   help="default: the config's validation size (val_height, else height), else the native size cropped to 8*patch")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--use_ref_vae", action="store_true", help="also evaluate the reference VAE and report ratios")
    p.add_argument("--ref_vae_path", default=None, help="diffusers folder (default: the config's ref_vae_path)")
    p.add_argument("--ref_vae_class", default=None, choices=list(REF_VAE_CLASSES))
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--parallel", dest="parallel", action="store_true", default=True, help="all frames at once (default)")
    mode.add_argument("--sequential", dest="parallel", action="store_false", help="frame by frame, memory flat in T")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    p.add_argument("--channels_last", action=argparse.BooleanOptionalAction, default=True,
                   help="channels-last convolutions (default; faster on CPU, see docs/benchmarks.md; same results to fp rounding)")
    p.add_argument("--compile", action="store_true", help="torch.compile encode/decode (pays compile time on the first sample)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0, help="which samples are drawn (deterministic)")
    p.add_argument("--fps", type=float, default=None, help="fps of written videos (default: the source's)")
    p.add_argument("--output_dir", default="inference_results")
    args = p.parse_args(argv)
    if args.num_samples < 1:
        p.error("--num_samples must be >= 1")
    if args.n_frames is not None and args.n_frames < 1:
        p.error("--n_frames must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda requested but CUDA is not available")
    if args.dtype == "fp16" and not args.device.startswith("cuda"):
        p.error("--dtype fp16 needs a CUDA device")
    return args


def run_config_of(weights: Path) -> Path | None:
    """The ``config.json`` of the training run that wrote ``weights``: next to
    ``final_model.*``, one level above ``best_model/``, two above ``checkpoints/checkpoint-N/``."""
    folder = weights.parent
    if weights.name.startswith("final_model"):
        run_dir = folder
    elif folder.name == "best_model":
        run_dir = folder.parent
    elif folder.parent.name == "checkpoints":
        run_dir = folder.parent.parent
    else:
        return None
    return run_dir / "config.json" if (run_dir / "config.json").is_file() else None


def load_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[TAEHV, Path]:
    path = find_weights(args.model_path)
    variant = args.variant
    run_config = run_config_of(path)
    if variant is None and path.suffix == ".pth" and run_config is not None:
        variant = json.loads(run_config.read_text())["variant"]  # our own run: its config says
    model = TAEHV(path, variant=variant).to(device, dtype).eval()
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.compile:
        model.encode_video, model.decode_video = torch.compile(model.encode_video), torch.compile(model.decode_video)
    return model, path


def build_dataset(args: argparse.Namespace, model: TAEHV, output_dir: Path) -> tuple[VideoClipDataset, int]:
    config = load_config(args.config) if args.config else None
    n_frames = args.n_frames or (config.n_frames if config else 17)
    data_root, annotation = args.data_root, args.annotation_file
    if args.videos:
        files = []
        for v in args.videos:
            files += [str(Path(v, f).resolve()) for f in find_videos(v)] if Path(v).is_dir() else [str(Path(v).resolve())]
        missing = [f for f in files if not Path(f).is_file()]
        if missing or not files:
            raise SystemExit(f"error: video file(s) not found: {', '.join(missing) or '(none given)'}")
        annotation = output_dir / "inputs.json"
        annotation.write_text(json.dumps({"total": len(files), "list": [{"full_path": f} for f in files]}, indent=1))
        data_root = None
    elif annotation is None and data_root is None:
        if config is None:
            raise SystemExit("error: give --videos, --annotation_file/--data_root or --config")
        data_root = resolve_path(config.data_root) if config.data_root else None
        annotation = resolve_path(config.val_annotation_file or config.annotation_file)
    height, width = args.height, args.width
    if height is None or width is None:
        if config is not None:
            height, width = height or config.validation_size[0], width or config.validation_size[1]
        else:
            probe = VideoClipDataset(data_root, annotation, n_frames=1, height=8, width=8, mode="val")
            info = probe_video(probe.clips.path(0))
            step = 8 * model.patch_size
            height, width = height or info.height // step * step, width or info.width // step * step
    dataset = VideoClipDataset(data_root, annotation, n_frames=n_frames, height=height, width=width, mode="val",
                               seed=args.seed, crop_scale=(1.0, 1.0))
    return dataset, n_frames


def reference_vae(args: argparse.Namespace, model: TAEHV, device: torch.device) -> ReferenceVAE:
    """The reference VAE of ``--config`` (or the defaults), with ``--ref_vae_path`` /
    ``--ref_vae_class`` and ``--dtype`` applied; latents are its mode, not samples."""
    config = load_config(args.config) if args.config else TrainConfig()
    config = config.replace(ref_vae_path=args.ref_vae_path or config.ref_vae_path,
                            ref_vae_class=args.ref_vae_class or config.ref_vae_class,
                            ref_vae_dtype=args.dtype, ref_latent_sample=False, variant=model.variant)
    if not config.ref_vae_path:
        raise SystemExit("error: --use_ref_vae needs --ref_vae_path (or a --config with ref_vae_path)")
    return ReferenceVAE.from_config(config, device, model.latent_channels)


def timed(fn, device: torch.device) -> tuple[torch.Tensor, float, float | None]:
    """(result, seconds, peak MB on CUDA) with the device synchronised around the call."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated(device) - before) / 2**20 if device.type == "cuda" else None
    return out, seconds, peak


def quality(decoded: torch.Tensor, target: torch.Tensor, use_lpips: bool) -> dict[str, float]:
    metrics = {
        "mse": float(video_mse(decoded, target)[0]),
        "psnr": float(video_psnr(decoded, target)[0]),
        "ssim": float(video_ssim(decoded, target)[0]),
        "temporal_error": float(video_temporal_error(decoded, target)[0]),
        "psnr_per_frame": [round(float(v), 3) for v in frame_psnr(decoded, target)[0]],
    }
    if use_lpips:
        metrics["lpips"] = float(video_lpips(decoded, target)[0])
    return metrics


def mean_std(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values) if len(values) > 1 else 0.0}


def summarise(samples: list[dict]) -> dict:
    summary = {}
    for who in ("taehv", "reference"):
        if who in samples[0]:
            keys = [k for k, v in samples[0][who].items() if isinstance(v, float)]
            summary[who] = {k: mean_std([s[who][k] for s in samples]) for k in keys}
    if "reference" in summary:
        ours, ref = summary["taehv"], summary["reference"]
        comparison = {
            "encode_speedup": ref["encode_s"]["mean"] / ours["encode_s"]["mean"],
            "decode_speedup": ref["decode_s"]["mean"] / ours["decode_s"]["mean"],
            "total_speedup": (ref["encode_s"]["mean"] + ref["decode_s"]["mean"])
            / (ours["encode_s"]["mean"] + ours["decode_s"]["mean"]),
            "psnr_gap_db": ours["psnr"]["mean"] - ref["psnr"]["mean"],
            "ssim_gap": ours["ssim"]["mean"] - ref["ssim"]["mean"],
        }
        if "decode_peak_mb" in ours and "decode_peak_mb" in ref:
            comparison["decode_memory_saving"] = 1 - ours["decode_peak_mb"]["mean"] / ref["decode_peak_mb"]["mean"]
        summary["comparison"] = comparison
    return summary


@torch.inference_mode()
def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    output_dir = Path(args.output_dir)
    (output_dir / "comparison_videos").mkdir(parents=True, exist_ok=True)
    (output_dir / "latent_visualizations").mkdir(parents=True, exist_ok=True)
    (output_dir / "stills").mkdir(parents=True, exist_ok=True)

    model, weights = load_model(args, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"✅ Model loaded: {weights} ({model.variant}, {n_params / 1e6:.2f}M parameters, {device}, {args.dtype})")
    dataset, n_frames = build_dataset(args, model, output_dir)
    plan = model.plan(n_frames)
    ref_vae = None
    if args.use_ref_vae:
        ref_vae = reference_vae(args, model, device)
    use_lpips = lpips_unavailable_reason() is None  # metrics logs why not

    count = min(args.num_samples, len(dataset))
    order = np.random.default_rng(args.seed).permutation(len(dataset))[:count] if not args.videos else np.arange(count)
    print(f"✅ Processing {count} samples: {n_frames} frames at {dataset.height}x{dataset.width} "
          f"({plan.latent_frames} latents, {plan.aligned_frames} aligned decoded frames compared)")

    def warm_up(frames: torch.Tensor) -> None:  # first calls pay one-off costs (allocator, kernels)
        model.decode_video(model.encode_video(frames, parallel=args.parallel), parallel=args.parallel)
        if ref_vae is not None:
            ref_vae.decode(ref_vae.encode(frames))

    samples = []
    for i, index in enumerate(tqdm(order, desc="samples", disable=None)):
        item = dataset[int(index)]
        frames = frames_to_unit(item["frames"].unsqueeze(0), device, dtype)
        if i == 0:
            warm_up(frames)
        latents, enc_s, enc_mb = timed(lambda: model.encode_video(frames, parallel=args.parallel), device)
        decoded, dec_s, dec_mb = timed(lambda: model.decode_video(latents, parallel=args.parallel), device)
        decoded, target = plan.aligned(decoded.float(), frames.float())
        result = {"index": int(item["index"]), "source": dataset.clips.path(int(item["index"])),
                  "latent_shape": list(latents.shape),
                  "taehv": {**quality(decoded, target, use_lpips), "encode_s": enc_s, "decode_s": dec_s}}
        if enc_mb is not None:
            result["taehv"].update(encode_peak_mb=enc_mb, decode_peak_mb=dec_mb)
        line = f"Sample {i + 1}: MSE={result['taehv']['mse']:.4f}, PSNR={result['taehv']['psnr']:.1f}dB, " \
               f"SSIM={result['taehv']['ssim']:.3f}, Encoding Time={enc_s:.3f}s, Decoding Time={dec_s:.3f}s"
        if ref_vae is not None:
            ref_latents, r_enc_s, r_enc_mb = timed(lambda: ref_vae.encode(frames), device)
            ref_decoded, r_dec_s, r_dec_mb = timed(lambda: ref_vae.decode(ref_latents), device)
            n = min(ref_decoded.shape[1], n_frames)
            result["reference"] = {**quality(ref_decoded[:, :n], frames[:, :n].float(), use_lpips),
                                   "encode_s": r_enc_s, "decode_s": r_dec_s}
            if r_enc_mb is not None:
                result["reference"].update(encode_peak_mb=r_enc_mb, decode_peak_mb=r_dec_mb)
            line += f"\n  Reference VAE - PSNR={result['reference']['psnr']:.1f}dB, " \
                    f"decode {r_dec_s / dec_s:.1f}x slower than TAEHV"
        tqdm.write(line)

        stem = f"test_{i}"
        fps = args.fps or probe_fps(result["source"])
        original, reconstructed = to_uint8_frames(target[0]), to_uint8_frames(decoded[0])
        codec = write_video(output_dir / "comparison_videos" / f"{stem}_original.mp4", original, fps)
        write_video(output_dir / "comparison_videos" / f"{stem}_reconstructed.mp4", reconstructed, fps)
        comparison = side_by_side(original, reconstructed)
        write_video(output_dir / "comparison_videos" / f"{stem}_comparison.mp4", comparison, fps)
        write_png(output_dir / "comparison_videos" / f"{stem}_poster.png", comparison[len(comparison) // 2])
        write_png(output_dir / "latent_visualizations" / f"{stem}_latents.png", latent_picture(latents[0]))
        reference = to_uint8_frames(ref_decoded[0, :n]) if ref_vae is not None else None
        stills, shown = comparison_stills(original, reconstructed, reference)
        write_png(output_dir / "stills" / f"{stem}_stills.png", stills)
        result["files"] = {"original_video": f"comparison_videos/{stem}_original.mp4",
                           "reconstructed_video": f"comparison_videos/{stem}_reconstructed.mp4",
                           "comparison_video": f"comparison_videos/{stem}_comparison.mp4",
                           "poster_png": f"comparison_videos/{stem}_poster.png",
                           "latents_png": f"latent_visualizations/{stem}_latents.png",
                           "stills_png": f"stills/{stem}_stills.png", "stills_frames": shown, "codec": codec}
        samples.append(result)

    results = {
        "model": {"path": str(weights), "variant": model.variant, "parameters_m": n_params / 1e6},
        "settings": {"n_frames": n_frames, "height": dataset.height, "width": dataset.width, "parallel": args.parallel,
                     "dtype": args.dtype, "device": str(device), "seed": args.seed,
                     "channels_last": args.channels_last, "compile": args.compile,
                     "latent_frames": plan.latent_frames, "compared_frames": plan.aligned_frames,
                     "lpips": use_lpips, "reference_vae": bool(ref_vae)},
        "samples": samples,
        "summary": summarise(samples),
    }
    (output_dir / "metrics.json").write_text(json.dumps(results, indent=2))
    report = write_report(output_dir, results)
    print_summary(results)
    print(f"✅ Wrote {output_dir / 'metrics.json'}, {len(samples)} comparison videos and {report}")
    return results


def write_png(path: Path, image: np.ndarray) -> None:
    """An HWC uint8 RGB image as PNG."""
    if not cv2.imwrite(str(path), cv2.cvtColor(image, cv2.COLOR_RGB2BGR)):
        raise OSError(f"cannot write {path}")


def probe_fps(path: str) -> float:
    cap = cv2.VideoCapture(path)
    fps = cap.get(cv2.CAP_PROP_FPS)
    cap.release()
    return fps if fps and math.isfinite(fps) and fps > 0 else 24.0


def print_summary(results: dict) -> None:
    summary = results["summary"]
    ours = summary["taehv"]
    print("\nFinal Evaluation Results:")
    print("├─ Reconstruction Quality (TAEHV)")
    for key, label in (("mse", "MSE"), ("psnr", "PSNR (dB)"), ("ssim", "SSIM"), ("lpips", "LPIPS"),
                       ("temporal_error", "Temporal error")):
        if key in ours:
            print(f"│   ├─ {label}: {ours[key]['mean']:.4f} ± {ours[key]['std']:.4f}")
    print("├─ Performance")
    print(f"│   ├─ Encoding: {ours['encode_s']['mean']:.3f}s   Decoding: {ours['decode_s']['mean']:.3f}s")
    if "comparison" in summary:
        c = summary["comparison"]
        ref = summary["reference"]
        print(f"└─ vs Reference VAE (PSNR {ref['psnr']['mean']:.2f} dB, decode {ref['decode_s']['mean']:.3f}s)")
        print(f"    ├─ Quality gap: {c['psnr_gap_db']:+.2f} dB PSNR, {c['ssim_gap']:+.3f} SSIM")
        print(f"    └─ Speed-up: encode {c['encode_speedup']:.1f}x, decode {c['decode_speedup']:.1f}x, "
              f"total {c['total_speedup']:.1f}x")


if __name__ == "__main__":
    exit_on_config_error(main)
