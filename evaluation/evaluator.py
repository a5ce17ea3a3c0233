"""The evaluation engine behind ``inference.py``: clips in, aligned metrics, timings and files out.

``Evaluator`` takes the clips one by one (a clip that cannot give a sample is skipped and
reported, never replaced), times the model (and the reference VAE) with the device
synchronised, compares the decoded frames with the input frames the model's FramePlan
aligns them to, and writes comparison videos, a poster, a latent picture and stills per
sample; ``summarise`` turns the samples into means, standard deviations and ratios. Running
out of memory names what was being done and what to lower.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
import torch
from tqdm.auto import tqdm

from taehv_train.base.atomic import atomic_write
from taehv_train.base.errors import UserError
from taehv_train.common.clips import VideoClipDataset, frames_to_unit
from taehv_train.common.metrics import ReconstructionMetrics, rms_ratio
from taehv_train.common.preview_score import preview_decode, preview_scores
from taehv_train.common.reference_vae import ReferenceVAE
from taehv_train.common.video.files import BadClipError
from taehv_train.common.video.writer import write_video
from taehv_train.evaluation.frame_size import FrameSize
from taehv_train.evaluation.stills import comparison_stills
from taehv_train.evaluation.timing import timed
from taehv_train.evaluation.videos import latent_picture, rgb_beside_alpha, side_by_side, to_uint8_frames
from taehv_train.models.frames import FramePlan
from taehv_train.models.taehv import TAEHV
from taehv_train.models.vae_registry import reference_vae_frames


def is_out_of_memory(err: RuntimeError) -> bool:
    """CUDA raises torch.OutOfMemoryError; the CPU allocator a plain RuntimeError."""
    return isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in str(err)


@dataclass(frozen=True)
class EvaluationOptions:
    """The options of an evaluation that the engine uses (``inference.py`` fills them from its
    flags; the out-of-memory advice names those flags)."""

    device: str  # as given, e.g. "cuda:1"
    dtype: str  # a key of common.config.DTYPES, e.g. "bf16"
    parallel: bool  # all frames at once; False: frame by frame
    compile: bool  # the model's blocks are compiled: the warm-up runs on a whole clip
    use_ref_vae: bool  # the reference VAE is evaluated too
    fps: float | None  # of the written videos; None: the source's


def memory_advice(options: EvaluationOptions) -> str:
    """What the user can lower or switch, given the options of this run."""
    advice = ["lower --height/--width or --n_frames"]
    if options.parallel:
        advice.append("use --sequential (memory flat in the number of frames)")
    if options.device.startswith("cuda") and options.dtype == "fp32":
        advice.append("use --dtype bf16")
    if options.use_ref_vae:
        advice.append("leave out --use_ref_vae (the reference VAE needs far more memory)")
    return "; ".join(advice)


@contextmanager
def out_of_memory_hint(options: EvaluationOptions, doing: str) -> Iterator[None]:
    """Running out of memory while ``doing`` something becomes one line that says what it was
    and what to lower (the allocator's own message names neither)."""
    try:
        yield
    except RuntimeError as err:
        if not is_out_of_memory(err):
            raise
        raise UserError(f"out of memory while {doing}{requested_memory(err)}: {memory_advice(options)}") from err


def requested_memory(err: RuntimeError) -> str:
    """ "; it asked for 20.00 GiB more" from CUDA's or the CPU allocator's message, else ""."""
    found = re.search(r"(?i)tried to allocate (?:([\d.]+ ?[KMGT]i?B)|(\d+) bytes)", str(err))
    if found is None:
        return ""
    return f"; it asked for {found.group(1) or f'{int(found.group(2)) / 2**30:.2f} GiB'} more"


def quality_metrics(decoded: torch.Tensor, target: torch.Tensor, use_lpips: bool) -> dict[str, float]:
    """One clip's decoded frames against the frames they are aligned to (LPIPS when ``use_lpips``):
    a number per metric, the per-frame PSNR as a list rounded to 3 decimals."""
    metrics = ReconstructionMetrics(rgba=decoded.shape[2] == 4, lpips=use_lpips, temporal=True)
    return {
        name: [round(float(v), 3) for v in value[0]] if value.dim() == 2 else float(value[0])
        for name, value in metrics(decoded, target).items()
    }


def mean_std(values: list[float]) -> dict[str, float | None]:
    """The mean, and the spread where there is one: ``std`` is None for a single sample."""
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values) if len(values) > 1 else None}


def mean_text(stats: dict[str, float | None], mean_format: str, std_format: str) -> str:
    """ "mean ± std" of ``mean_std``'s result, the mean alone for a single sample (no spread)."""
    shown = format(stats["mean"], mean_format)
    return shown if stats["std"] is None else f"{shown} ± {format(stats['std'], std_format)}"


def summarise(samples: list[dict]) -> dict:
    summary = {}
    for who in ("taehv", "reference", "preview"):
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
        if ratios:  # the model's latent RMS over the reference VAE's (common.metrics.rms_ratio)
            comparison["latent_rms_ratio"] = statistics.fmean(ratios)
        summary["comparison"] = comparison
    return summary


@dataclass
class Evaluator:
    """Evaluates clips one by one, each at the size ``size`` gives it, with everything a
    sample needs, and names what it is doing when memory runs out."""

    options: EvaluationOptions
    model: TAEHV
    ref_vae: ReferenceVAE | None
    dataset: VideoClipDataset
    size: FrameSize
    device: torch.device
    dtype: torch.dtype
    use_lpips: bool
    output_dir: Path
    warmed_up: set[tuple[int, int]] = field(default_factory=set)  # the sizes the timings' warm-up has seen

    @property
    def plan(self) -> FramePlan:
        return self.model.plan(self.dataset.n_frames)

    def doing(self, what: str, clip: torch.Tensor) -> AbstractContextManager[None]:
        """``out_of_memory_hint`` for ``what``, with the size of ``clip`` (its last two
        dimensions are its height and width) and the mode of this run."""
        mode = "parallel" if self.options.parallel else "sequential"
        height, width = clip.shape[-2:]
        return out_of_memory_hint(
            self.options,
            f"{what} ({self.dataset.n_frames} frames at {height}x{width}, {mode}, "
            f"{self.options.dtype} on {self.device})",
        )

    def evaluate(self, order: np.ndarray, count: int) -> tuple[list[dict], list[dict]]:
        """(samples, skipped clips): the first ``count`` clips of ``order`` that can give a
        sample; a clip that cannot (too short, unreadable) is skipped and reported, never
        replaced by a clip already in the list, so no clip weighs twice in the means. Clips
        the dataset left out up front (annotated as too short) are reported too."""
        samples, skipped = (
            [],
            [
                {
                    "source": source,
                    "kind": "too short",
                    "reason": "too short: annotated with fewer "
                    f"than the {self.dataset.min_frames} frames a sample needs",
                }
                for source in self.dataset.short_clips
            ],
        )
        skipped += [
            {"source": source, "kind": "refused entry", "reason": why} for source, why in self.dataset.refused_entries
        ]
        with tqdm(total=count, desc="samples", disable=None) as progress:
            for index in map(int, order):
                if len(samples) == count:
                    break
                source = self.dataset.clips.path(index)
                try:
                    clip = self.dataset.load_clip(index, self.size.of)
                except BadClipError as err:
                    skipped.append({"source": source, "kind": err.kind, "reason": str(err)})
                    tqdm.write(f"⚠️  Skipped {source}: {err}")
                    continue
                with self.doing(f"loading sample {len(samples) + 1} onto {self.device}", clip):
                    frames = frames_to_unit(clip.unsqueeze(0), self.device, self.dtype)
                if tuple(clip.shape[-2:]) not in self.warmed_up:  # each size's first call pays its one-off costs
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
        short = frames if self.options.compile else frames[:, :1]
        self.warmed_up.add(tuple(frames.shape[-2:]))
        with self.doing(f"warming up on {short.shape[1]} frame(s) of a clip", frames):
            self.model.decode_video(
                self.model.encode_video(short, parallel=self.options.parallel), parallel=self.options.parallel
            )
            if self.ref_vae is not None:  # the fewest frames it takes (MiniMax H3: 18; Allegro: 24)
                fewest = next(
                    (t for t in range(1, frames.shape[1]) if reference_vae_frames(t, self.model.spec)), frames.shape[1]
                )
                self.ref_vae.decode(self.ref_vae.encode(frames[:, :fewest]))

    def sample(self, i: int, index: int, source: str, frames: torch.Tensor) -> dict:
        """Metrics, timings and output files of sample ``i`` (clip ``index``)."""
        parallel, device = self.options.parallel, self.device
        with self.doing(f"encoding sample {i + 1}", frames):
            latents, enc_s, enc_mb = timed(lambda: self.model.encode_video(frames, parallel=parallel), device)
        with self.doing(f"decoding sample {i + 1}", frames):
            decoded, dec_s, dec_mb = timed(lambda: self.model.decode_video(latents, parallel=parallel), device)
        decoded, target = self.plan.aligned(decoded.float(), frames.float())
        with self.doing(f"computing the metrics of sample {i + 1}", frames):
            ours = {**quality_metrics(decoded, target, self.use_lpips), "encode_s": enc_s, "decode_s": dec_s}
        if enc_mb is not None:
            ours.update(encode_peak_mb=enc_mb, decode_peak_mb=dec_mb)
        with self.doing(f"decoding the first latent of sample {i + 1} alone (the preview score)", frames):
            preview = self.preview(latents, {"": frames})
        height, width = frames.shape[-2:]
        result = {
            "index": index,
            "source": source,
            "height": height,
            "width": width,
            "latent_shape": list(latents.shape),
            "taehv": ours,
            "preview": {"frames": list(range(self.model.first_latent_frames())), **preview},
        }
        line = (
            f"Sample {i + 1} ({height}x{width}): MSE={ours['mse']:.4f}, PSNR={ours['psnr']:.1f}dB, "
            f"SSIM={ours['ssim']:.3f}, preview PSNR={preview['psnr']:.1f}dB, "
            f"Encoding Time={enc_s:.3f}s, Decoding Time={dec_s:.3f}s"
        )
        ref_decoded = None
        if self.ref_vae is not None:
            with self.doing(f"running the reference VAE on sample {i + 1}", frames):
                result["reference"], ref_decoded, ref_latents = self.reference(frames)
            if ref_latents.shape == latents.shape:  # the same latent space: are they on the same scale?
                result["latent_rms_ratio"] = float(rms_ratio(latents, ref_latents))
            if ref_latents.shape[2:] == latents.shape[2:]:  # latents the TAE decodes: what a preview is given
                with self.doing(f"decoding the reference VAE's first latent of sample {i + 1} alone", frames):
                    result["preview"].update(
                        self.preview(
                            ref_latents.to(self.dtype),
                            {"_from_reference_latents": frames, "_vs_reference_decode": ref_decoded},
                        )
                    )
            line += (
                f"\n  Reference VAE - PSNR={result['reference']['psnr']:.1f}dB, "
                f"decode {result['reference']['decode_s'] / dec_s:.1f}x slower than TAEHV"
            )
        tqdm.write(line)
        with self.doing(f"writing the videos and pictures of sample {i + 1}", frames):
            result["files"] = self.write_files(i, source, target, decoded, latents, ref_decoded)
        return result

    def preview(self, latents: torch.Tensor, targets: dict[str, torch.Tensor]) -> dict[str, float]:
        """The preview score (``common.preview_score``) of ``latents``: their first latent decoded
        alone, against the first frames of each target, named metric + the target's suffix."""
        shown = preview_decode(self.model, latents, parallel=self.options.parallel)
        return {
            f"{metric}{suffix}": float(value[0])
            for suffix, target in targets.items()
            for metric, value in preview_scores(shown, target).items()
        }

    def reference(self, frames: torch.Tensor) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """(metrics and timings, decoded frames, latents) of the reference VAE on ``frames``."""
        ref_latents, enc_s, enc_mb = timed(lambda: self.ref_vae.encode(frames), self.device)
        decoded, dec_s, dec_mb = timed(lambda: self.ref_vae.decode(ref_latents), self.device)
        n = min(decoded.shape[1], frames.shape[1])
        metrics = {
            **quality_metrics(decoded[:, :n], frames[:, :n].float(), self.use_lpips),
            "encode_s": enc_s,
            "decode_s": dec_s,
        }
        if enc_mb is not None:
            metrics.update(encode_peak_mb=enc_mb, decode_peak_mb=dec_mb)
        return metrics, decoded[:, :n], ref_latents

    def write_files(
        self,
        i: int,
        source: str,
        target: torch.Tensor,
        decoded: torch.Tensor,
        latents: torch.Tensor,
        ref_decoded: torch.Tensor | None,
    ) -> dict:
        """Comparison videos, poster, latent picture and stills of sample ``i``; their paths."""
        out, stem = self.output_dir, f"test_{i}"
        fps = self.options.fps or probe_fps(source)
        original, reconstructed = to_uint8_frames(target[0]), to_uint8_frames(decoded[0])  # RGB or RGBA
        shown_original, shown_reconstructed = rgb_beside_alpha(original), rgb_beside_alpha(reconstructed)
        codec = write_video(out / "comparison_videos" / f"{stem}_original.mp4", shown_original, fps)
        write_video(out / "comparison_videos" / f"{stem}_reconstructed.mp4", shown_reconstructed, fps)
        labels = ("original", "TAEHV") if original.shape[3] == 3 else ("original: RGB | alpha", "TAEHV: RGB | alpha")
        comparison = side_by_side(shown_original, shown_reconstructed, labels)
        write_video(out / "comparison_videos" / f"{stem}_comparison.mp4", comparison, fps)
        write_png(out / "comparison_videos" / f"{stem}_poster.png", comparison[len(comparison) // 2])
        write_png(out / "latent_visualizations" / f"{stem}_latents.png", latent_picture(latents[0]))
        reference = to_uint8_frames(ref_decoded[0]) if ref_decoded is not None else None
        stills, shown = comparison_stills(original, reconstructed, reference)
        write_png(out / "stills" / f"{stem}_stills.png", stills)
        return {
            "original_video": f"comparison_videos/{stem}_original.mp4",
            "reconstructed_video": f"comparison_videos/{stem}_reconstructed.mp4",
            "comparison_video": f"comparison_videos/{stem}_comparison.mp4",
            "poster_png": f"comparison_videos/{stem}_poster.png",
            "latents_png": f"latent_visualizations/{stem}_latents.png",
            "stills_png": f"stills/{stem}_stills.png",
            "stills_frames": shown,
            "codec": codec,
        }


def no_usable_clip(skipped: list[dict], dataset: VideoClipDataset) -> UserError:
    """The error when every clip tried was skipped: what to change, with an example."""
    n_frames, stride = dataset.n_frames, dataset.stride_range[0]
    clips, are = ("the clip", "is") if len(skipped) == 1 else (f"all {len(skipped)} clips", "are")
    example = f"e.g. {Path(skipped[0]['source']).name}: {skipped[0]['reason']}"
    if all(s["kind"] == "too short" for s in skipped):
        return UserError(
            f"{clips} {are} too short: --n_frames={n_frames} at --stride={stride} needs "
            f"{dataset.min_frames} frames ({example}): lower --n_frames or --stride"
        )
    if all(s["kind"] == "too small" for s in skipped):  # the reason says which size to give
        first = skipped[0]
        return UserError(
            f"{clips} {are} too small: {Path(first['source']).name} is {first['reason'].removeprefix('too small: ')}"
        )
    return UserError(f"{clips} could not be used ({example}); check the videos or the annotation")


def write_png(path: Path, image: np.ndarray) -> None:
    """An HWC uint8 RGB or RGBA image as PNG (RGBA: with its alpha channel)."""
    order = cv2.COLOR_RGBA2BGRA if image.shape[2] == 4 else cv2.COLOR_RGB2BGR
    converted = cv2.cvtColor(image, order)

    def write(tmp: Path) -> None:
        if not cv2.imwrite(str(tmp), converted):
            raise OSError(f"cannot write {path}")

    atomic_write(path, write)


def probe_fps(path: str) -> float:
    cap = cv2.VideoCapture(path)
    fps = cap.get(cv2.CAP_PROP_FPS)
    cap.release()
    return fps if fps and math.isfinite(fps) and fps > 0 else 24.0
