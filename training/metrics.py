"""Reconstruction metrics on aligned frames (torchmetrics), shared by validation and inference.

Inputs are NTCHW videos in [0, 1] whose frame i already corresponds (see
``models.frames.FramePlan.target``); metrics average over all frames of a video.
"""
from __future__ import annotations

import functools
import logging

import torch
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

logger = logging.getLogger(__name__)


def video_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-video MSE (N,)."""
    return (pred.float() - target.float()).square().flatten(1).mean(1)


def video_psnr(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-video PSNR in dB over all its frames (N,), data range 1."""
    return torch.stack([peak_signal_noise_ratio(p.float(), t.float(), data_range=1.0) for p, t in zip(pred, target)])


def frame_psnr(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-frame PSNR in dB (N, T), data range 1: where in a clip reconstruction fails."""
    return torch.stack([peak_signal_noise_ratio(p.float(), t.float(), data_range=1.0, reduction="none", dim=(1, 2, 3))
                        for p, t in zip(pred, target)])


def video_ssim(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-video SSIM (Gaussian window 11) averaged over frames (N,)."""
    return torch.stack([structural_similarity_index_measure(p.float(), t.float(), data_range=1.0) for p, t in zip(pred, target)])


def video_temporal_error(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-video mean absolute error of frame-to-frame differences (N,): flicker and
    motion errors that per-frame metrics miss. Zero for a single frame."""
    if pred.shape[1] < 2:
        return pred.new_zeros(pred.shape[0])
    return (pred.float().diff(dim=1) - target.float().diff(dim=1)).abs().flatten(1).mean(1)


@functools.cache
def lpips_unavailable_reason() -> str | None:
    """None when torchmetrics' LPIPS can be built here, else why not.

    LPIPS is an optional extra: only a missing module counts as "unavailable" (torchvision
    not installed, for which torchmetrics' constructor raises ModuleNotFoundError, or no
    LPIPS module in torchmetrics); the reason is logged once. Any other error, e.g. backbone
    weights that cannot be loaded, propagates with its own message.
    """
    try:
        from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity

        LearnedPerceptualImagePatchSimilarity(net_type="alex", normalize=True)
    except ImportError as err:  # ModuleNotFoundError is a subclass
        reason = f"{type(err).__name__}: {err} (install the optional extra: pip install -r requirements-lpips.txt)"
        logger.info("LPIPS is unavailable: %s", reason)
        return reason
    return None


@functools.cache
def _lpips_model(device: str):
    from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity

    return LearnedPerceptualImagePatchSimilarity(net_type="alex", normalize=True, reduction="mean").to(device).eval()


def video_lpips(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-video LPIPS (N,); only call when ``lpips_unavailable_reason()`` is None."""
    model = _lpips_model(str(pred.device))
    return torch.stack([model(p.float().clamp(0, 1), t.float().clamp(0, 1)) for p, t in zip(pred, target)])
