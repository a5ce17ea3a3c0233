"""The distillation recipe's losses, all on frames aligned by the model's FramePlan.

- encoder:        MSE(encode(x), z_ref)           -> TAEHV latents live in the reference space
- decoder:        MSE(decode(z_ref), x)           -> the decoder works behind a diffusion model
- reconstruction: MSE(decode(encode(x)), x)       -> end-to-end consistency
- lpips (optional) on decode(encode(x)).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models.taehv import AutoencoderOutput
from training.latent_check import rms_ratio


def _mse(pred: torch.Tensor, target: torch.Tensor, what: str) -> torch.Tensor:
    if pred.shape != target.shape:
        raise RuntimeError(f"{what}: prediction {tuple(pred.shape)} and target {tuple(target.shape)} differ "
                           "(frame arithmetic mismatch; this is a bug, please report it)")
    return F.mse_loss(pred.float(), target.float())


def compute_losses(
    out: AutoencoderOutput,
    targets: torch.Tensor,
    reference_latents: torch.Tensor | None,
    encoder_weight: float,
    decoder_weight: float,
    reconstruction_weight: float,
    lpips_weight: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Weighted total ``loss`` plus each term that was computed (unweighted, for logging),
    and the latent RMS ratio to the reference (``training.latent_check``) when there is one."""
    terms: dict[str, tuple[torch.Tensor, float]] = {}
    if reference_latents is not None:
        terms["encoder_loss"] = (_mse(out.latents, reference_latents, "encoder loss"), encoder_weight)
        terms["decoder_loss"] = (_mse(out.decoded_from_reference, targets, "decoder loss"), decoder_weight)
    if out.decoded is not None:
        terms["reconstruction_loss"] = (_mse(out.decoded, targets, "reconstruction loss"), reconstruction_weight)
        if lpips_weight > 0:
            from training.metrics import video_lpips

            terms["lpips_loss"] = (video_lpips(out.decoded, targets).mean(), lpips_weight)
    if not terms:
        raise RuntimeError("no loss term was computed: give reference latents or decode the model's own latents")
    losses = {name: value for name, (value, _) in terms.items()}
    losses["loss"] = sum(weight * value for value, weight in terms.values())
    if reference_latents is not None:  # logged beside the losses (train/latent_rms_ratio), not trained on
        losses["latent_rms_ratio"] = rms_ratio(out.latents, reference_latents)
    return losses
