"""Is the TAE on the reference VAE's latent scale? The check users of TAEs forget.

Each TAE works on the reference VAE's latents in one space (raw, scaled by
``scaling_factor``, normalised by ``latents_mean``/``latents_std``: ``models.latent_spaces``),
and a TAE trained or used in another space produces washed-out or saturated video. The
published TAEs' author advises comparing the latent RMS at training and test time: this
module does it, in the TAE's space. ``compare`` gives the RMS ratio
(``common.metrics.rms_ratio``) and per-channel statistics; ``diagnose`` names the space and
the likely cause when the ratio is far from 1 (``guess_space``: which of the VAE's spaces
the model's latents look like). Training checks a few clips at start-up (a loud
warning when the model starts from published or earlier weights) and logs
``train/latent_rms_ratio``; ``inference.py --use_ref_vae`` reports it in metrics.json and
the report.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from taehv_train.common.metrics import rms, rms_ratio
from taehv_train.models.latent_spaces import LatentTransform, SpaceGuess, guess_space

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


def diagnose(scale: LatentScale, transform: LatentTransform, guess: SpaceGuess | None = None) -> str | None:
    """None when the scales agree; otherwise what differs, in which space, and the likely
    cause: the model's latents looking like another of the VAE's spaces (``guess``), or
    weights of another variant or VAE."""
    if not scale.far_from_one:
        return None
    if guess is not None and guess.best is not None and guess.best != transform.space:
        cause = (
            f"the model's latents look {guess.best}: weights trained in another space (published LightTAE "
            f"weights use raw latents, madebyollin's their model's; set latent_space={guess.best} to keep it)"
        )
    else:
        cause = (
            "the weights belong to another variant or another VAE's latent space (check variant, ref_vae_class "
            "and ref_vae_path)"
        )
    return (
        f"latent scale check: the model's latents have RMS {scale.model_rms:.3g}, the reference VAE's "
        f"{scale.reference_rms:.3g} in the TAE's {transform.describe()} (ratio {scale.rms_ratio:.3g}, "
        f"{len(scale.reference_mean)} channels); likely cause: {cause}"
    )


def check_at_start(
    model_latents: torch.Tensor,
    reference_latents: torch.Tensor,
    pretrained: bool,
    transform: LatentTransform,
    spaces: dict[str, LatentTransform],
) -> LatentScale:
    """Log the comparison of a few clips' latents (``reference_latents`` in the TAE's space,
    ``transform``); a loud warning when a model that starts from published or earlier weights
    is off the reference scale (from scratch it cannot be on it yet), naming which of the
    VAE's ``spaces`` its latents look like."""
    scale = compare(model_latents, reference_latents)
    problem = diagnose(scale, transform, guess_space(model_latents, spaces))
    if problem is not None and pretrained:
        logger.warning("WARNING %s", problem)
    else:
        logger.info(
            "latent scale check: RMS ratio %.3g (model %.3g, reference VAE %.3g, %s)%s",
            scale.rms_ratio,
            scale.model_rms,
            scale.reference_rms,
            transform.describe(),
            "" if pretrained else "; the model starts from scratch",
        )
    if not math.isfinite(scale.rms_ratio):
        logger.warning("latent scale check: a non-finite RMS ratio; the reference latents may be all zeros")
    return scale
