"""Is the TAE on the reference VAE's latent scale? The check users of TAEs forget.

A TAE decodes the raw latents a pipeline passes to ``vae.decode``; diffusers pipelines
apply ``scaling_factor`` or ``latents_mean``/``latents_std`` around the diffusion model,
and a TAE trained or used on the wrong side of that scaling produces washed-out or
saturated video. The published TAEs' author advises comparing the latent RMS at training
and test time: this module does it. ``compare`` gives the RMS ratio
(``common.metrics.rms_ratio``) and per-channel statistics; ``diagnose`` names the likely
cause when the ratio is far from 1. Training checks a few clips at start-up (a loud
warning when the model starts from published or earlier weights) and logs
``train/latent_rms_ratio``; ``inference.py --use_ref_vae`` reports it in metrics.json and
the report.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from common.metrics import rms, rms_ratio

logger = logging.getLogger(__name__)
TOLERANCE = 2.0  # a ratio beyond [1/2, 2] is "far from 1"


@dataclass(frozen=True)
class LatentScale:
    """Both latents' overall RMS and per-channel mean and std (NTCHW: channels on dim 2)."""

    rms_ratio: float
    model_rms: float
    reference_rms: float
    model_mean: list[float]
    model_std: list[float]
    reference_mean: list[float]
    reference_std: list[float]

    @property
    def far_from_one(self) -> bool:
        return not (1 / TOLERANCE <= self.rms_ratio <= TOLERANCE)


def compare(model_latents: torch.Tensor, reference_latents: torch.Tensor) -> LatentScale:
    def per_channel(z: torch.Tensor) -> tuple[list[float], list[float]]:
        flat = z.detach().float().transpose(0, 2).flatten(1)  # channels first
        return flat.mean(1).tolist(), flat.std(1).tolist()

    model_mean, model_std = per_channel(model_latents)
    reference_mean, reference_std = per_channel(reference_latents)
    return LatentScale(
        float(rms_ratio(model_latents, reference_latents)),
        float(rms(model_latents)),
        float(rms(reference_latents)),
        model_mean,
        model_std,
        reference_mean,
        reference_std,
    )


def diagnose(scale: LatentScale) -> str | None:
    """None when the scales agree; otherwise what differs and the likely cause."""
    if not scale.far_from_one:
        return None
    channels = len(scale.reference_mean)
    normalised = (
        all(abs(m) < 0.15 for m in scale.reference_mean)
        and all(0.75 < s < 1.33 for s in scale.reference_std)
        and not all(abs(m) < 0.15 for m in scale.model_mean)
    )
    cause = (
        "the reference latents look normalised (every channel mean ~0, std ~1): a pipeline's latents_mean/"
        "latents_std or scaling_factor was applied to them, but a TAE works on the raw latents of "
        "vae.encode(...).latent_dist"
        if normalised
        else "the weights belong to another variant or another VAE's latent space (check variant, ref_vae_class "
        "and ref_vae_path), or were trained on scaled or normalised latents"
    )
    return (
        f"latent scale check: the model's latents have RMS {scale.model_rms:.3g}, the reference VAE's "
        f"{scale.reference_rms:.3g} (ratio {scale.rms_ratio:.3g}, {channels} channels); likely cause: {cause}"
    )


def check_at_start(model_latents: torch.Tensor, reference_latents: torch.Tensor, pretrained: bool) -> LatentScale:
    """Log the comparison of a few clips' latents; a loud warning when a model that starts
    from published or earlier weights is off the reference scale (from scratch it cannot
    be on it yet)."""
    scale = compare(model_latents, reference_latents)
    problem = diagnose(scale)
    if problem is not None and pretrained:
        logger.warning("WARNING %s", problem)
    else:
        logger.info(
            "latent scale check: RMS ratio %.3g (model %.3g, reference VAE %.3g)%s",
            scale.rms_ratio,
            scale.model_rms,
            scale.reference_rms,
            "" if pretrained else "; the model starts from scratch",
        )
    if not math.isfinite(scale.rms_ratio):
        logger.warning("latent scale check: a non-finite RMS ratio; the reference latents may be all zeros")
    return scale
