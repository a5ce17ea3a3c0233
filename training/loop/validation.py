"""Validation on held-out clips: PSNR/SSIM (LPIPS when installed) of aligned frames, and the
preview score (the first latent decoded alone, as a live preview shows it: ``common.preview_score``).

Samples are split across ranks and the per-sample metrics gathered, so every rank takes
part in the same collectives (no rank waits on another that skipped work); when a rank
cannot read its clips, the ranks agree on it first and all raise ValidationDataError.
"""

from __future__ import annotations

import logging

import cv2
import numpy as np
import torch
from accelerate import Accelerator

from taehv_train.common.clips import VideoClipDataset, VideoDataError, frames_to_unit
from taehv_train.common.config import TrainConfig
from taehv_train.common.metrics import ReconstructionMetrics, lpips_unavailable_reason, video_psnr
from taehv_train.common.preview_score import preview_decode, preview_scores
from taehv_train.common.reference_vae import ReferenceVAE
from taehv_train.models.taehv import TAEHV
from taehv_train.training.loop.resilience import agree

logger = logging.getLogger(__name__)
STRIP_FRAMES = 6
FROM_REFERENCE = ("psnr_from_reference_latents", "preview_psnr_from_reference_latents")  # with a reference VAE


class ValidationDataError(VideoDataError):
    """The validation clips became unreadable on some rank (files deleted, a mount gone);
    raised on every rank together, so the run can save its last step and stop."""


def reconstruction_strip(original: torch.Tensor, decoded: torch.Tensor, frames: int = STRIP_FRAMES) -> torch.Tensor:
    """CHW image: up to ``frames`` evenly spaced original frames on top, decoded below, each
    row under a label band naming it and the frame numbers (a strip must say what it shows)."""
    idx = torch.linspace(0, original.shape[0] - 1, min(frames, original.shape[0])).round().long()
    numbers = ", ".join(str(i) for i in idx.tolist())
    rows = []
    for label, video in ((f"input, frames {numbers}", original), (f"decoded, frames {numbers}", decoded)):
        row = torch.cat(list(video[idx]), dim=2).clamp(0, 1).cpu()
        rows += [label_band(label, row.shape[2], row.shape[0]), row]
    return torch.cat(rows, dim=1)


LABEL_HEIGHT = 14  # pixels: OpenCV's smallest legible font


def label_band(text: str, width: int, channels: int) -> torch.Tensor:
    """A CHW band of ``width`` pixels with ``text`` in white on black (cut at the band's end)."""
    band = np.zeros((LABEL_HEIGHT, width), np.uint8)
    cv2.putText(band, text, (2, LABEL_HEIGHT - 4), cv2.FONT_HERSHEY_SIMPLEX, 0.35, 255, 1, cv2.LINE_AA)
    return torch.from_numpy(band).float().div(255).expand(channels, -1, -1)


@torch.no_grad()
def validate(
    accelerator: Accelerator,
    model: TAEHV,
    dataset: VideoClipDataset,
    config: TrainConfig,
    ref_vae: ReferenceVAE | None,
    dtype: torch.dtype,
) -> dict:
    model.eval()
    n = min(config.num_validation_samples, len(dataset))
    mine = list(range(accelerator.process_index, n, accelerator.num_processes))
    measured = ReconstructionMetrics(
        rgba=model.image_channels == 4, lpips=lpips_unavailable_reason() is None, own=("preview_psnr", "preview_ssim")
    )
    names = [f"val/{name}" for name in measured.names + (list(FROM_REFERENCE) if ref_vae is not None else [])]
    rows, strip, unreadable = [], None, None
    for start in range(0, len(mine), config.validation_batch_size):
        try:
            items = [dataset[i] for i in mine[start : start + config.validation_batch_size]]
        except VideoDataError as err:  # every replacement failed too: the data went away
            unreadable = err
            break
        frames = frames_to_unit(torch.stack([item["frames"] for item in items]), accelerator.device)
        plan = model.plan(frames.shape[1])
        with accelerator.autocast():  # the model runs in the training precision, the metrics below in fp32
            latents = model.encode_video(frames.to(dtype))
            decoded, target = plan.aligned(model.decode_video(latents).float(), frames)
            preview = preview_decode(model, latents)
            if ref_vae is not None:
                ref_latents = ref_vae.encode(frames).to(dtype)
                from_ref, _ = plan.aligned(model.decode_video(ref_latents).float(), frames)
                preview_from_ref = preview_decode(model, ref_latents)
        previewed = preview_scores(preview, frames)
        columns = measured(decoded, target, {f"preview_{name}": value for name, value in previewed.items()})
        if ref_vae is not None:
            columns.update(
                zip(FROM_REFERENCE, (video_psnr(from_ref, target), preview_scores(preview_from_ref, frames)["psnr"]))
            )
        rows.append(torch.stack([c.float() for c in columns.values()], 1))
        if strip is None and accelerator.is_main_process:
            strip = reconstruction_strip(target[0], decoded[0])
    if agree([unreadable is not None], accelerator.device)[0]:  # before the gather, which would wait forever
        if unreadable is not None:
            raise ValidationDataError(unreadable.reason, unreadable.advice)
        raise ValidationDataError("validation clips unreadable on another rank")
    per_rank = -(-n // accelerator.num_processes)
    local = torch.full((per_rank, len(names)), float("nan"), device=accelerator.device)
    if rows:
        local[: sum(len(r) for r in rows)] = torch.cat(rows)
    gathered = accelerator.gather(local)
    gathered = gathered[~gathered.isnan().any(1)]
    metrics = {name: float(gathered[:, i].mean()) for i, name in enumerate(names)}
    metrics["val/samples"] = float(len(gathered))
    if strip is not None:
        metrics["strip"] = strip
    return metrics
