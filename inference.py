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
import re
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from evaluation.report import write_report  # noqa: E402
from evaluation.stills import comparison_stills  # noqa: E402
from evaluation.videos import latent_picture, side_by_side, to_uint8_frames, write_video  # noqa: E402
from models.checkpoint import find_weights, read_metadata  # noqa: E402
from models.frames import FramePlan  # noqa: E402
from models.taehv import TAEHV  # noqa: E402
from models.variants import get_variant  # noqa: E402
from training.config import DTYPES, REF_VAE_CLASSES, TrainConfig, load_config, resolve_path  # noqa: E402
from training.dataset import (  # noqa: E402
    VIDEO_EXTENSIONS, BadClipError, VideoClipDataset, VideoDataError, find_videos, frames_to_unit, probe_video)
from training.errors import ConfigError, exit_on_config_error  # noqa: E402
from training.export import run_folder_of  # noqa: E402
from training.metrics import (  # noqa: E402
    frame_psnr, lpips_unavailable_reason, video_lpips, video_mse, video_psnr, video_ssim, video_temporal_error)
from training.latent_check import rms_ratio  # noqa: E402
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
    p.add_argument("--stride", type=int, default=None,
                   help="temporal stride between the frames read (default: the config's validation stride "
                        "(stride_min + stride_max) // 2, else 1); clips too short for it are skipped and reported")
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
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model's blocks (TAEHV.compile, inductor); compilation happens in the "
                        "warm-up on the first clip and is not timed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0, help="which samples are drawn (deterministic)")
    p.add_argument("--fps", type=float, default=None, help="fps of written videos (default: the source's)")
    p.add_argument("--output_dir", default="inference_results")
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of user errors (files, options, out of memory) instead of one line")
    args = p.parse_args(argv)
    if args.num_samples < 1:
        p.error("--num_samples must be >= 1")
    if args.n_frames is not None and args.n_frames < 1:
        p.error("--n_frames must be >= 1")
    if args.stride is not None and args.stride < 1:
        p.error("--stride must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda requested but CUDA is not available")
    if args.dtype == "fp16" and not args.device.startswith("cuda"):
        p.error("--dtype fp16 needs a CUDA device")
    return args


def checked_variant(name: str) -> str:
    """The canonical name of a ``--variant``; an unknown one is the user's to fix."""
    try:
        return get_variant(name).name
    except ValueError as err:  # its message lists the known variants
        raise ConfigError(f"--variant: {err}") from err


def model_variant(requested: str | None, path: Path) -> str | None:
    """The variant to build for ``path``: ``--variant`` when the file does not say otherwise,
    else what our run's ``config.json`` says; None lets TAEHV read the file's metadata or name.

    A ``--variant`` that contradicts the file's metadata or its run's config is refused: it
    would evaluate the file with another frame rule and label the results wrongly."""
    metadata = read_metadata(path).get("variant")
    run = run_folder_of(path)
    run_config = run / "config.json" if run is not None else None
    from_run = json.loads(run_config.read_text()).get("variant") if run_config and not metadata else None
    if requested is None:
        return from_run
    variant = checked_variant(requested)
    for declared, where in ((metadata, "its metadata"), (from_run, f"its run's {run_config}")):
        if declared and declared != variant:
            raise ConfigError(f"{path} is a {declared} file ({where}), but --variant {requested} was given: "
                              "drop --variant")
    return variant


def load_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[TAEHV, Path]:
    path = find_weights(args.model_path)
    model = TAEHV(path, variant=model_variant(args.variant, path)).to(device, dtype).eval()
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.compile:
        model.compile()
        logger.info("torch.compile: the warm-up on the first clip compiles the encoder and the decoder")
    return model, path


def video_files(paths: list[str]) -> list[str]:
    """The video files named by ``--videos`` (files, or folders scanned for videos), absolute."""
    files = []
    for v in paths:
        if Path(v).is_dir():
            found = [str(Path(v, f).resolve()) for f in find_videos(v)]
            if not found:
                raise ConfigError(f"no videos ({', '.join(VIDEO_EXTENSIONS)}) in folder {v}")
            files += found
        else:
            files.append(str(Path(v).resolve()))
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise ConfigError(f"video file(s) not found: {', '.join(missing)}")
    return files


def default_stride(args: argparse.Namespace, config: TrainConfig | None) -> int:
    """``--stride``, else the stride validation reads the config's held-out clips at, else 1."""
    if args.stride is not None:
        return args.stride
    return (config.stride_min + config.stride_max) // 2 if config is not None else 1


def build_dataset(args: argparse.Namespace, model: TAEHV, output_dir: Path) -> VideoClipDataset:
    """The clips to evaluate, read at one fixed stride: a clip too short for it raises
    BadClipError (``short_clip_policy="skip"``) rather than being read at another stride,
    so ``settings.stride`` holds for every sample."""
    config = load_config(args.config) if args.config else None
    n_frames = args.n_frames or (config.n_frames if config else 17)
    data_root, annotation = args.data_root, args.annotation_file
    if args.videos:
        annotation = output_dir / "inputs.json"
        files = video_files(args.videos)
        annotation.write_text(json.dumps({"total": len(files), "list": [{"full_path": f} for f in files]}, indent=1))
        data_root = None
    elif annotation is None and data_root is None:
        if config is None:
            raise ConfigError("give --videos, --annotation_file/--data_root or --config")
        data_root = resolve_path(config.data_root) if config.data_root else None
        annotation = resolve_path(config.val_annotation_file or config.annotation_file)
    for name, path in (("annotation file", annotation), ("data root", data_root)):
        if path is not None and not Path(path).exists():
            raise ConfigError(f"{name} {path} not found")
    try:
        height, width = frame_size(args, config, model, data_root, annotation)
        multiple = 8 * model.patch_size
        if height % multiple or width % multiple:
            raise ConfigError(f"--height/--width {height}x{width}: {model.variant} needs multiples of {multiple} "
                              f"(8 * its patch size {model.patch_size}), e.g. {height // multiple * multiple or multiple}x"
                              f"{width // multiple * multiple or multiple}")
        stride = default_stride(args, config)
        return VideoClipDataset(data_root, annotation, n_frames=n_frames, height=height, width=width, mode="val",
                                seed=args.seed, crop_scale=(1.0, 1.0), stride_range=(stride, stride),
                                short_clip_policy="skip")
    except VideoDataError as err:  # e.g. no clips in the folder or annotation
        raise ConfigError(str(err)) from err


def frame_size(args: argparse.Namespace, config: TrainConfig | None, model: TAEHV, data_root: str | Path | None,
               annotation: str | Path | None) -> tuple[int, int]:
    """(height, width): the options, else the config's validation size, else the first
    clip's native size cropped to a multiple of 8 * patch."""
    height, width = args.height, args.width
    if height is not None and width is not None:
        return height, width
    if config is not None:
        return height or config.validation_size[0], width or config.validation_size[1]
    first = VideoClipDataset(data_root, annotation, n_frames=1, height=8, width=8, mode="val").clips.path(0)
    try:
        info = probe_video(first)
    except BadClipError as err:
        raise ConfigError(f"cannot read {first} to learn the frame size ({err}): give --height and --width") from err
    step = 8 * model.patch_size
    return height or info.height // step * step, width or info.width // step * step


def reference_vae(args: argparse.Namespace, model: TAEHV, device: torch.device) -> ReferenceVAE:
    """The reference VAE of ``--config`` (or the defaults), with ``--ref_vae_path`` /
    ``--ref_vae_class`` and ``--dtype`` applied; latents are its mode, not samples."""
    config = load_config(args.config) if args.config else TrainConfig()
    config = config.replace(ref_vae_path=args.ref_vae_path or config.ref_vae_path,
                            ref_vae_class=args.ref_vae_class or config.ref_vae_class,
                            ref_vae_dtype=args.dtype, ref_latent_sample=False, variant=model.variant)
    if not config.ref_vae_path:
        raise ConfigError("--use_ref_vae needs --ref_vae_path (or a --config with ref_vae_path)")
    return ReferenceVAE.from_config(config, device)


def is_out_of_memory(err: RuntimeError) -> bool:
    """CUDA raises torch.OutOfMemoryError; the CPU allocator a plain RuntimeError."""
    return isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in str(err)


def memory_advice(args: argparse.Namespace) -> str:
    """What the user can lower or switch, given the options of this run."""
    advice = ["lower --height/--width or --n_frames"]
    if args.parallel:
        advice.append("use --sequential (memory flat in the number of frames)")
    if args.device.startswith("cuda") and args.dtype == "fp32":
        advice.append("use --dtype bf16")
    if args.use_ref_vae:
        advice.append("leave out --use_ref_vae (the reference VAE needs far more memory)")
    return "; ".join(advice)


@contextmanager
def out_of_memory_hint(args: argparse.Namespace, doing: str) -> Iterator[None]:
    """Running out of memory while ``doing`` something becomes one line that says what it was
    and what to lower (the allocator's own message names neither)."""
    try:
        yield
    except RuntimeError as err:
        if not is_out_of_memory(err):
            raise
        raise ConfigError(f"out of memory while {doing}{requested_memory(err)}: {memory_advice(args)}") from err


def requested_memory(err: RuntimeError) -> str:
    """"; it asked for 20.00 GiB more" from CUDA's or the CPU allocator's message, else ""."""
    found = re.search(r"(?i)tried to allocate (?:([\d.]+ ?[KMGT]i?B)|(\d+) bytes)", str(err))
    if found is None:
        return ""
    return f"; it asked for {found.group(1) or f'{int(found.group(2)) / 2**30:.2f} GiB'} more"


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
        ratios = [s["latent_rms_ratio"] for s in samples if "latent_rms_ratio" in s]
        if ratios:  # the model's latent RMS over the reference VAE's (training.latent_check)
            comparison["latent_rms_ratio"] = statistics.fmean(ratios)
        summary["comparison"] = comparison
    return summary


@dataclass
class Evaluator:
    """Evaluates clips one by one with everything a sample needs, and names what it is doing
    when memory runs out."""
    args: argparse.Namespace
    model: TAEHV
    ref_vae: ReferenceVAE | None
    dataset: VideoClipDataset
    device: torch.device
    dtype: torch.dtype
    use_lpips: bool
    output_dir: Path

    @property
    def plan(self) -> FramePlan:
        return self.model.plan(self.dataset.n_frames)

    def doing(self, what: str) -> AbstractContextManager[None]:
        """``out_of_memory_hint`` for ``what``, with the sizes and mode of this run."""
        mode = "parallel" if self.args.parallel else "sequential"
        return out_of_memory_hint(self.args, f"{what} ({self.dataset.n_frames} frames at {self.dataset.height}x"
                                             f"{self.dataset.width}, {mode}, {self.args.dtype} on {self.device})")

    def evaluate(self, order: np.ndarray, count: int) -> tuple[list[dict], list[dict]]:
        """(samples, skipped clips): the first ``count`` clips of ``order`` that can give a
        sample; a clip that cannot (too short, unreadable) is skipped and reported, never
        replaced by a clip already in the list, so no clip weighs twice in the means. Clips
        the dataset left out up front (annotated as too short) are reported too."""
        samples, skipped = [], [{"source": source, "kind": "too short", "reason": "too short: annotated with fewer "
                                 f"than the {self.dataset.min_frames} frames a sample needs"}
                                for source in self.dataset.short_clips]
        with tqdm(total=count, desc="samples", disable=None) as progress:
            for index in map(int, order):
                if len(samples) == count:
                    break
                source = self.dataset.clips.path(index)
                try:
                    clip = self.dataset.load_clip(index)
                except BadClipError as err:
                    skipped.append({"source": source, "kind": err.kind, "reason": str(err)})
                    tqdm.write(f"⚠️  Skipped {source}: {err}")
                    continue
                with self.doing(f"loading sample {len(samples) + 1} onto {self.device}"):
                    frames = frames_to_unit(clip.unsqueeze(0), self.device, self.dtype)
                if not samples:
                    self.warm_up(frames)
                samples.append(self.sample(len(samples), index, source, frames))
                progress.update()
        if not samples:
            raise no_usable_clip(skipped, self.dataset)
        return samples, skipped

    def warm_up(self, frames: torch.Tensor) -> None:
        """First calls pay one-off costs (allocator, kernels), kept out of the timings. One
        frame at the real size does that without the memory of a whole extra clip (with
        --compile the whole clip, so that compilation sees the real shapes)."""
        short = frames if self.args.compile else frames[:, :1]
        with self.doing(f"warming up on {short.shape[1]} frame(s) of the first clip"):
            self.model.decode_video(self.model.encode_video(short, parallel=self.args.parallel),
                                    parallel=self.args.parallel)
            if self.ref_vae is not None:  # MiniMax H3's VAE decodes nothing shorter than 18 frames
                self.ref_vae.decode(self.ref_vae.encode(frames if self.ref_vae.facts.h3_chunks else short))

    def sample(self, i: int, index: int, source: str, frames: torch.Tensor) -> dict:
        """Metrics, timings and output files of sample ``i`` (clip ``index``)."""
        parallel, device = self.args.parallel, self.device
        with self.doing(f"encoding sample {i + 1}"):
            latents, enc_s, enc_mb = timed(lambda: self.model.encode_video(frames, parallel=parallel), device)
        with self.doing(f"decoding sample {i + 1}"):
            decoded, dec_s, dec_mb = timed(lambda: self.model.decode_video(latents, parallel=parallel), device)
        decoded, target = self.plan.aligned(decoded.float(), frames.float())
        with self.doing(f"computing the metrics of sample {i + 1}"):
            ours = {**quality(decoded, target, self.use_lpips), "encode_s": enc_s, "decode_s": dec_s}
        if enc_mb is not None:
            ours.update(encode_peak_mb=enc_mb, decode_peak_mb=dec_mb)
        result = {"index": index, "source": source, "latent_shape": list(latents.shape), "taehv": ours}
        line = f"Sample {i + 1}: MSE={ours['mse']:.4f}, PSNR={ours['psnr']:.1f}dB, " \
               f"SSIM={ours['ssim']:.3f}, Encoding Time={enc_s:.3f}s, Decoding Time={dec_s:.3f}s"
        ref_decoded = None
        if self.ref_vae is not None:
            with self.doing(f"running the reference VAE on sample {i + 1}"):
                result["reference"], ref_decoded, ref_latents = self.reference(frames)
            if ref_latents.shape == latents.shape:  # the same latent space: are they on the same scale?
                result["latent_rms_ratio"] = float(rms_ratio(latents, ref_latents))
            line += f"\n  Reference VAE - PSNR={result['reference']['psnr']:.1f}dB, " \
                    f"decode {result['reference']['decode_s'] / dec_s:.1f}x slower than TAEHV"
        tqdm.write(line)
        with self.doing(f"writing the videos and pictures of sample {i + 1}"):
            result["files"] = self.write_files(i, source, target, decoded, latents, ref_decoded)
        return result

    def reference(self, frames: torch.Tensor) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """(metrics and timings, decoded frames, latents) of the reference VAE on ``frames``."""
        ref_latents, enc_s, enc_mb = timed(lambda: self.ref_vae.encode(frames), self.device)
        decoded, dec_s, dec_mb = timed(lambda: self.ref_vae.decode(ref_latents), self.device)
        n = min(decoded.shape[1], frames.shape[1])
        metrics = {**quality(decoded[:, :n], frames[:, :n].float(), self.use_lpips), "encode_s": enc_s, "decode_s": dec_s}
        if enc_mb is not None:
            metrics.update(encode_peak_mb=enc_mb, decode_peak_mb=dec_mb)
        return metrics, decoded[:, :n], ref_latents

    def write_files(self, i: int, source: str, target: torch.Tensor, decoded: torch.Tensor, latents: torch.Tensor,
                    ref_decoded: torch.Tensor | None) -> dict:
        """Comparison videos, poster, latent picture and stills of sample ``i``; their paths."""
        out, stem = self.output_dir, f"test_{i}"
        fps = self.args.fps or probe_fps(source)
        original, reconstructed = to_uint8_frames(target[0]), to_uint8_frames(decoded[0])
        codec = write_video(out / "comparison_videos" / f"{stem}_original.mp4", original, fps)
        write_video(out / "comparison_videos" / f"{stem}_reconstructed.mp4", reconstructed, fps)
        comparison = side_by_side(original, reconstructed)
        write_video(out / "comparison_videos" / f"{stem}_comparison.mp4", comparison, fps)
        write_png(out / "comparison_videos" / f"{stem}_poster.png", comparison[len(comparison) // 2])
        write_png(out / "latent_visualizations" / f"{stem}_latents.png", latent_picture(latents[0]))
        reference = to_uint8_frames(ref_decoded[0]) if ref_decoded is not None else None
        stills, shown = comparison_stills(original, reconstructed, reference)
        write_png(out / "stills" / f"{stem}_stills.png", stills)
        return {"original_video": f"comparison_videos/{stem}_original.mp4",
                "reconstructed_video": f"comparison_videos/{stem}_reconstructed.mp4",
                "comparison_video": f"comparison_videos/{stem}_comparison.mp4",
                "poster_png": f"comparison_videos/{stem}_poster.png",
                "latents_png": f"latent_visualizations/{stem}_latents.png",
                "stills_png": f"stills/{stem}_stills.png", "stills_frames": shown, "codec": codec}


def no_usable_clip(skipped: list[dict], dataset: VideoClipDataset) -> ConfigError:
    """The error when every clip tried was skipped: what to change, with an example."""
    n_frames, stride = dataset.n_frames, dataset.stride_range[0]
    clips, are = ("the clip", "is") if len(skipped) == 1 else (f"all {len(skipped)} clips", "are")
    example = f"e.g. {Path(skipped[0]['source']).name}: {skipped[0]['reason']}"
    if all(s["kind"] == "too short" for s in skipped):
        return ConfigError(f"{clips} {are} too short: --n_frames={n_frames} at --stride={stride} needs "
                           f"{dataset.min_frames} frames ({example}): lower --n_frames or --stride")
    return ConfigError(f"{clips} could not be used ({example}); check the videos or the annotation")


@torch.inference_mode()
def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    output_dir = Path(args.output_dir)
    for folder in ("comparison_videos", "latent_visualizations", "stills"):
        (output_dir / folder).mkdir(parents=True, exist_ok=True)

    with out_of_memory_hint(args, f"loading the model onto {device}"):
        model, weights = load_model(args, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"✅ Model loaded: {weights} ({model.variant}, {n_params / 1e6:.2f}M parameters, {device}, {args.dtype})")
    dataset = build_dataset(args, model, output_dir)
    ref_vae = None
    if args.use_ref_vae:
        with out_of_memory_hint(args, f"loading the reference VAE onto {device}"):
            ref_vae = reference_vae(args, model, device)
    use_lpips = lpips_unavailable_reason() is None  # metrics logs why not
    evaluator = Evaluator(args, model, ref_vae, dataset, device, dtype, use_lpips, output_dir)
    plan, stride = evaluator.plan, dataset.stride_range[0]

    count = min(args.num_samples, len(dataset))
    order = np.random.default_rng(args.seed).permutation(len(dataset)) if not args.videos else np.arange(len(dataset))
    print(f"✅ Processing {count} samples: {dataset.n_frames} frames at stride {stride}, {dataset.height}x{dataset.width} "
          f"({plan.latent_frames} latents, {plan.aligned_frames} aligned decoded frames compared)")
    samples, skipped = evaluator.evaluate(order, count)

    results = {
        "model": {"path": str(weights), "variant": model.variant, "parameters_m": n_params / 1e6},
        "settings": {"n_frames": dataset.n_frames, "stride": stride, "height": dataset.height, "width": dataset.width,
                     "parallel": args.parallel, "dtype": args.dtype, "device": str(device), "seed": args.seed,
                     "channels_last": args.channels_last, "compile": args.compile,
                     "latent_frames": plan.latent_frames, "compared_frames": plan.aligned_frames,
                     "lpips": use_lpips, "reference_vae": bool(ref_vae)},
        "samples": samples,
        "skipped": skipped,
        "summary": summarise(samples),
    }
    (output_dir / "metrics.json").write_text(json.dumps(results, indent=2))
    report = write_report(output_dir, results)
    print_summary(results)
    skipped_note = f" (skipped clips: {len(skipped)}, listed there)" if skipped else ""
    print(f"✅ Wrote {output_dir / 'metrics.json'}{skipped_note}, {len(samples)} comparison videos and {report}")
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
