#!/usr/bin/env python3
r"""Evaluate a TAEHV: aligned PSNR/SSIM/MSE (LPIPS when installed), temporal error, speed and
memory, optionally next to the reference VAE; writes metrics.json, comparison videos,
latent pictures and summary_report.html.

    python inference.py --model_path output/<run>     # its best validation (--weights final: its final model)
    python inference.py --model_path output/<run>/final_model.safetensors --config training/configs/taehv_config_demo.py
    python inference.py --model_path checkpoints/taecvx.pth --videos clip1.mp4 clip2.mp4 --use_ref_vae \
        --ref_vae_path checkpoints/CogVideoX-2b --num_samples 50 --output_dir results
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from taehv_train.base.atomic import atomic_write
from taehv_train.base.errors import USER_ERRORS, UserError, exit_on_user_error
from taehv_train.base.flags import ArgumentParser
from taehv_train.common.clips import VideoClipDataset, VideoDataError
from taehv_train.common.config import DTYPES, TrainConfig, load_config
from taehv_train.common.config_ranges import COUNT, RANGES, Range
from taehv_train.common.devices import checked_device, default_device
from taehv_train.common.metrics import lpips_unavailable_reason
from taehv_train.common.reference_vae import ReferenceVAE
from taehv_train.common.run_files import WEIGHT_CHOICES, RunWeights, run_folder_of, run_weights
from taehv_train.common.shard_source import is_shard_source, source_errors
from taehv_train.common.video.files import clip_extensions, find_videos
from taehv_train.evaluation.evaluator import EvaluationOptions, Evaluator, mean_text, out_of_memory_hint, summarise
from taehv_train.evaluation.frame_size import FrameSize, describe
from taehv_train.evaluation.provenance import TRAINING, RunSets
from taehv_train.evaluation.report import write_report
from taehv_train.models.latent_spaces import AUTO_SPACE, SPACES
from taehv_train.models.taehv import TAEHV
from taehv_train.models.unloaded_references import reference_latents_note
from taehv_train.models.vae_classes import REF_VAE_CLASSES
from taehv_train.models.vae_registry import AUTO_CLASS
from taehv_train.models.variants import get_variant
from taehv_train.models.weights import read_metadata

logger = logging.getLogger("inference")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model_path",
        required=True,
        help="weights (.pth/.safetensors, ours or published), a training checkpoint or best_model folder, "
        "or a run folder (its best validation, see --weights; its config.json gives the defaults)",
    )
    p.add_argument(
        "--weights",
        choices=WEIGHT_CHOICES,
        default=None,
        help="which weights of a run folder: best (the default: its best validation, or its final weights when it "
        "did not validate) or final (its final model; its newest checkpoint when unfinished)",
    )
    p.add_argument("--variant", default=None, help="architecture when the file does not say (e.g. taecvx)")
    p.add_argument(
        "--config",
        default=None,
        help="training config (a Python config or a run's config.json): default data (val set), size and frames "
        "(default: the config.json of the run the weights come from)",
    )
    src = p.add_argument_group("data (one of --videos, --annotation_file/--data_root, --config)")
    src.add_argument("--videos", nargs="+", default=None, help="video files or folders")
    src.add_argument("--data_root", default=None)
    src.add_argument("--annotation_file", default=None)
    p.add_argument(
        "--num_samples",
        type=int,
        default=10,
        help="how many clips to evaluate (default: %(default)s; all when there are fewer)",
    )
    p.add_argument("--n_frames", type=int, default=None, help="frames per sample (default: config or 17)")
    p.add_argument(
        "--stride",
        type=int,
        default=None,
        help="temporal stride between the frames read (default: the config's validation stride "
        "(stride_min + stride_max) // 2, else 1); clips too short for it are skipped and reported",
    )
    p.add_argument(
        "--height",
        type=int,
        default=None,
        help="default: the config's validation size (val_height, else height), else the native size cropped to 8*patch",
    )
    p.add_argument("--width", type=int, default=None)
    p.add_argument(
        "--native_size",
        action="store_true",
        help="evaluate at the clips' own size (cropped to 8*patch) rather than the config's validation size",
    )
    p.add_argument("--use_ref_vae", action="store_true", help="also evaluate the reference VAE and report ratios")
    p.add_argument("--ref_vae_path", default=None, help="diffusers folder (default: the config's ref_vae_path)")
    p.add_argument(
        "--ref_vae_class",
        default=None,
        choices=[AUTO_CLASS, *REF_VAE_CLASSES],
        help="the reference VAE's class (default: the config's, else auto: from the folder's config.json)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--parallel", dest="parallel", action="store_true", default=True, help="all frames at once (default)"
    )
    mode.add_argument("--sequential", dest="parallel", action="store_false", help="frame by frame, memory flat in T")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    p.add_argument(
        "--channels_last",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="channels-last convolutions (default; faster on CPU, see docs/benchmarks.md; same results to fp rounding)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model's blocks (TAEHV.compile, inductor); compilation happens in the "
        "warm-up on the first clip and is not timed",
    )
    p.add_argument("--device", default=default_device(), help="cpu, cuda, cuda:N or mps (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="which samples are drawn (deterministic)")
    p.add_argument("--fps", type=float, default=None, help="fps of written videos (default: the source's)")
    p.add_argument("--output_dir", default="inference_results")
    p.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of user errors (files, options, out of memory) instead of one line",
    )
    return checked_options(p.parse_args(argv))


# the numeric flags' ranges: the config keys' (common.config_ranges.RANGES) where a flag stands for one
OPTION_RANGES = {
    "num_samples": Range(1, COUNT),
    "n_frames": RANGES["n_frames"],
    "stride": RANGES["stride_max"],
    "height": RANGES["height"],
    "width": RANGES["width"],
    "seed": RANGES["seed"],
    "fps": Range(0, 1000, open_low=True),
}


def checked_options(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` once its values are in range and its device is usable here; else a UserError
    (one line), before any model is built or output folder made."""
    for flag, bounds in OPTION_RANGES.items():
        if (value := getattr(args, flag)) is not None and (problem := bounds.problem(f"--{flag}", value)):
            raise UserError(problem)
    if checked_device(args.device).type != "cuda" and args.dtype == "fp16":
        raise UserError("--dtype fp16 needs a CUDA device")
    return args


def evaluation_options(args: argparse.Namespace) -> EvaluationOptions:
    """The flags the evaluation engine uses."""
    return EvaluationOptions(
        device=args.device,
        dtype=args.dtype,
        parallel=args.parallel,
        compile=args.compile,
        use_ref_vae=args.use_ref_vae,
        fps=args.fps,
    )


def checked_variant(name: str) -> str:
    """The canonical name of a ``--variant``; an unknown one is the user's to fix."""
    try:
        return get_variant(name).name
    except ValueError as err:  # its message lists the known variants
        raise UserError(f"--variant: {err}") from err


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
            raise UserError(
                f"{path} is a {declared} file ({where}), but --variant {requested} was given: drop --variant"
            )
    return variant


def load_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[TAEHV, RunWeights]:
    """The model of ``--model_path`` and ``--weights`` (``run_weights``: which weights, and
    the line that says so); the folder they come from is held until they are loaded, so the
    rotation of a run still training cannot remove it meanwhile."""
    with ExitStack() as held:
        chosen = run_weights(args.model_path, args.weights, held)
        path = chosen.path
        model = TAEHV(path, variant=model_variant(args.variant, path)).to(device, dtype).eval()
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.compile:
        model.compile()
        logger.info("torch.compile: the warm-up on the first clip compiles the encoder and the decoder")
    return model, chosen


def evaluation_config(args: argparse.Namespace, weights: Path) -> tuple[TrainConfig | None, str]:
    """The config that gives the defaults: ``--config``, else the saved config of the run the
    weights come from; and where it came from, for the messages."""
    if args.config:
        return load_config(args.config), f"--config {args.config}"
    run = run_folder_of(weights)
    return (load_config(run / "config.json"), f"the run's {run / 'config.json'}") if run else (None, "")


def video_files(paths: list[str]) -> list[str]:
    """The clips named by ``--videos``: files, or folders scanned for videos and images,
    absolute. A name that is not there is an error; one that is there but cannot be read (a
    FIFO or a device too) is left to the evaluation, which skips and reports it."""
    files = []
    for v in paths:
        if Path(v).is_dir():
            found = [str(Path(v, f).resolve()) for f in find_videos(v, images=True)]
            if not found:
                raise UserError(f"no videos or images ({', '.join(clip_extensions(images=True))}) in folder {v}")
            files += found
        else:
            files.append(str(Path(v).resolve()))
    missing = [f for f in files if not Path(f).exists()]
    if missing:
        raise UserError(f"video file(s) not found: {', '.join(missing)}")
    return files


def default_stride(args: argparse.Namespace, config: TrainConfig | None) -> int:
    """``--stride``, else the stride validation reads the config's held-out clips at, else 1."""
    if args.stride is not None:
        return args.stride
    return (config.stride_min + config.stride_max) // 2 if config is not None else 1


def build_dataset(
    args: argparse.Namespace, config: TrainConfig | None, size: FrameSize, output_dir: Path, channels: int
) -> VideoClipDataset:
    """The clips to evaluate, read at one fixed stride: a clip too short for it raises
    BadClipError (``short_clip_policy="skip"``) rather than being read at another stride,
    so ``settings.stride`` holds for every sample. Each sample's size comes from ``size``
    (the dataset's own height and width stand in for a side taken from each clip)."""
    n_frames = args.n_frames or (config.n_frames if config else 17)
    data_root, annotation = args.data_root, args.annotation_file
    if args.videos:
        annotation = output_dir / "inputs.json"
        files = video_files(args.videos)
        atomic_write(annotation, json.dumps({"total": len(files), "list": [{"full_path": f} for f in files]}, indent=1))
        data_root = None
    elif annotation is None and data_root is None:
        if config is None:
            raise UserError("give --videos, --annotation_file/--data_root or --config")
        data_root = config.data_root or None
        annotation = config.val_annotation_file or config.annotation_file
        if not config.val_annotation_file:
            logger.warning("the config has no validation set: evaluating its training clips (give --videos for others)")
    for name, path in (("annotation file", annotation), ("data root", data_root)):
        if path is not None and is_shard_source(str(path)):
            if errors := source_errors(str(path)):
                raise UserError(f"{name}: {errors[0]}")
        elif path is not None and not Path(path).exists():
            raise UserError(f"{name} {path} not found")
    try:
        stride = default_stride(args, config)
        return VideoClipDataset(
            data_root,
            annotation,
            n_frames=n_frames,
            height=size.height or size.multiple,
            width=size.width or size.multiple,
            mode="val",
            seed=args.seed,
            crop_scale=(1.0, 1.0),
            stride_range=(stride, stride),
            short_clip_policy="skip",
            channels=channels,
        )
    except VideoDataError as err:  # e.g. no clips in the folder or annotation
        raise UserError(str(err)) from err


def frame_size(args: argparse.Namespace, config: TrainConfig | None, model: TAEHV) -> FrameSize:
    """The size of the samples: the options, else the config's validation size (unless
    ``--native_size``), else each clip's own cropped to a multiple of 8 * patch (a portrait
    clip stays portrait; a clip smaller than one multiple is skipped and reported). A given
    side that is no such multiple is an error."""
    height, width = args.height, args.width
    if config is not None and not args.native_size:
        height, width = height or config.validation_size[0], width or config.validation_size[1]
    multiple = 8 * model.patch_size
    wrong = [n for n in (height, width) if n is not None and (n < multiple or n % multiple)]
    if wrong:
        fixed = [None if n is None else max(n // multiple * multiple, multiple) for n in (height, width)]
        raise UserError(
            f"--height/--width {describe(height, width)}: {model.variant} needs multiples of {multiple} "
            f"(8 * its patch size {model.patch_size}), e.g. {describe(*fixed)}"
        )
    return FrameSize(height, width, multiple, model.variant)


def reference_vae(
    args: argparse.Namespace, config: TrainConfig | None, model: TAEHV, device: torch.device
) -> ReferenceVAE:
    """The reference VAE of ``--ref_vae_path`` / ``--ref_vae_class``, else of the ``ref_vae_*``
    keys of the config (or their defaults), in ``--dtype``, checked against the model's
    variant; latents are its mode, not samples, in the model's latent space (the one its
    weights carry; for weights with a space of their own, the variant's)."""
    path = args.ref_vae_path or (config.ref_vae_path if config else "")
    if not path:
        raise UserError("--use_ref_vae needs --ref_vae_path (or a --config with ref_vae_path)")
    vae_class = args.ref_vae_class or (config.ref_vae_class if config else AUTO_CLASS)
    subfolder = config.ref_vae_subfolder if config else "vae"
    space = model.latent_space if model.latent_space in SPACES else AUTO_SPACE
    return ReferenceVAE.for_variant(model.variant, path, vae_class, subfolder, args.dtype, device, False, space)


def prepare_output_dir(output_dir: Path) -> Path:
    """The output folders, and proof that they can be written, before any work is done."""
    try:
        for folder in ("comparison_videos", "latent_visualizations", "stills"):
            (output_dir / folder).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as err:
        raise UserError(
            f"cannot write into --output_dir {output_dir}: {err.strerror or err}; choose a folder you can write"
        ) from None
    return output_dir


@torch.inference_mode()
def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    options = evaluation_options(args)

    # the models first: a wrong weight file or reference VAE folder leaves no output folder behind
    with out_of_memory_hint(options, f"loading the model onto {device}"):
        model, chosen = load_model(args, device, dtype)
    weights, n_params = chosen.path, sum(p.numel() for p in model.parameters())
    if chosen.told:
        print(f"✅ Weights: {chosen.told}")
    print(f"✅ Model loaded: {weights} ({model.variant}, {n_params / 1e6:.2f}M parameters, {device}, {args.dtype})")
    config, config_source = evaluation_config(args, weights)
    if config_source:
        print(f"✅ Defaults (data, size, frames, stride) from {config_source}")
    ref_vae = None
    if args.use_ref_vae:
        with out_of_memory_hint(options, f"loading the reference VAE onto {device}"):
            ref_vae = reference_vae(args, config, model, device)
    size = frame_size(args, config, model)
    output_dir, new_folder = Path(args.output_dir), not Path(args.output_dir).exists()
    prepare_output_dir(output_dir)
    try:
        dataset = build_dataset(args, config, size, output_dir, model.image_channels)
        lpips_missing = lpips_unavailable_reason()
        if lpips_missing is not None:
            print(f"⚠️  LPIPS is left out: {lpips_missing}")
        use_lpips = lpips_missing is None
        evaluator = Evaluator(options, model, ref_vae, dataset, size, device, dtype, use_lpips, output_dir)
        plan, stride = evaluator.plan, dataset.stride_range[0]
        count = min(args.num_samples, len(dataset))
        sets = RunSets.of(config)
        drawn = np.random.default_rng(args.seed).permutation(len(dataset)) if not args.videos else range(len(dataset))
        order = sets.preferred([int(i) for i in drawn], dataset.clips.path)
        print(
            f"✅ Processing {count} sample{'s' * (count != 1)}: {dataset.n_frames} frames at stride {stride}, "
            f"{size}{size_note(args, config)} "
            f"({plan.latent_frames} latents, {plan.aligned_frames} aligned decoded frames compared)"
        )
        if (note := reference_latents_note(model.variant, dataset.n_frames)) is not None:
            print(f"⚠️  {note}")
        samples, skipped = evaluator.evaluate(np.asarray(order), count)
    except USER_ERRORS:  # nothing could be evaluated: leave no output folder behind
        if new_folder:
            shutil.rmtree(output_dir)
        raise
    for sample in samples:
        sample["split"] = sets.split(sample["source"])
    trained_on = sum(s["split"] == TRAINING for s in samples)
    if trained_on:
        print(
            f"⚠️  {trained_on} of the {len(samples)} samples are clips the model was trained on: they flatter it "
            "(the report marks each sample held-out, training or neither)"
        )

    results = {
        "model": {
            "path": str(weights),
            "step": chosen.step,
            "which": chosen.told,
            "variant": model.variant,
            "parameters_m": n_params / 1e6,
        },
        "settings": {
            "n_frames": dataset.n_frames,
            "stride": stride,
            "height": size.height,
            "width": size.width,
            "native_size": size.native,
            "parallel": args.parallel,
            "dtype": args.dtype,
            "device": str(device),
            "seed": args.seed,
            "channels_last": args.channels_last,
            "compile": args.compile,
            "latent_frames": plan.latent_frames,
            "compared_frames": plan.aligned_frames,
            "lpips": use_lpips,
            "reference_vae": bool(ref_vae),
        },
        "samples": samples,
        "skipped": skipped,
        "summary": summarise(samples),
    }
    atomic_write(output_dir / "metrics.json", json.dumps(results, indent=2))
    report = write_report(output_dir, results)
    print_summary(results)
    skipped_note = f" (skipped clips: {len(skipped)}, listed there)" if skipped else ""
    print(f"✅ Wrote {output_dir / 'metrics.json'}{skipped_note}, {len(samples)} comparison videos and {report}")
    return results


def size_note(args: argparse.Namespace, config: TrainConfig | None) -> str:
    """Where the evaluated size came from, and the flag that gives the other one."""
    if args.height is not None and args.width is not None:
        return ""
    if config is not None and not args.native_size:
        return " (the config's validation size; --native_size for the clips' own)"
    return " (cropped to 8 * patch; --height/--width to resize)"


def print_summary(results: dict) -> None:
    summary = results["summary"]
    ours = summary["taehv"]
    print("\nFinal Evaluation Results:")
    print("├─ Reconstruction Quality (TAEHV)")
    for key, label in (
        ("mse", "MSE"),
        ("psnr", "PSNR (dB)"),
        ("ssim", "SSIM"),
        ("lpips", "LPIPS"),
        ("temporal_error", "Temporal error"),
    ):
        if key in ours:
            print(f"│   ├─ {label}: {mean_text(ours[key], '.4f', '.4f')}")
    preview = summary["preview"]
    print("├─ Preview score (the first latent decoded alone, as a live preview shows it)")
    psnr, ssim = mean_text(preview["psnr"], ".4f", ".4f"), mean_text(preview["ssim"], ".4f", ".4f")
    print(f"│   ├─ PSNR (dB): {psnr}   SSIM: {ssim}")
    if "psnr_vs_reference_decode" in preview:
        print(
            f"│   ├─ of the reference VAE's latents: PSNR (dB) "
            f"{mean_text(preview['psnr_from_reference_latents'], '.4f', '.4f')}; "
            f"against the reference VAE's decode {mean_text(preview['psnr_vs_reference_decode'], '.4f', '.4f')}"
        )
    print("├─ Performance")
    print(f"│   ├─ Encoding: {ours['encode_s']['mean']:.3f}s   Decoding: {ours['decode_s']['mean']:.3f}s")
    if "comparison" in summary:
        c = summary["comparison"]
        ref = summary["reference"]
        print(f"└─ vs Reference VAE (PSNR {ref['psnr']['mean']:.2f} dB, decode {ref['decode_s']['mean']:.3f}s)")
        print(f"    ├─ Quality gap: {c['psnr_gap_db']:+.2f} dB PSNR, {c['ssim_gap']:+.3f} SSIM")
        print(
            f"    └─ Speed-up: encode {c['encode_speedup']:.1f}x, decode {c['decode_speedup']:.1f}x, "
            f"total {c['total_speedup']:.1f}x"
        )


if __name__ == "__main__":
    exit_on_user_error(main)
