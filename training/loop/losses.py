"""The distillation recipe's losses, all on frames aligned by the model's FramePlan.

- encoder:        MSE(encode(x), z_ref)           -> TAEHV latents live in the reference space
- decoder:        MSE(decode(z_ref), x)           -> the decoder works behind a diffusion model
- reconstruction: MSE(decode(encode(x)), x)       -> end-to-end consistency
- lpips (optional) on decode(encode(x)).

What the forward decodes and which of these terms a step computes is one rule,
``loss_plan``: the step, the memory and FLOP estimates and the config check ask it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from taehv_train.common.config import TrainConfig
from taehv_train.common.metrics import lpips_unavailable_reason, rms_ratio
from taehv_train.models.taehv import AutoencoderOutput
from taehv_train.models.variants import VariantSpec


def uses_reference(config: TrainConfig) -> bool:
    """Whether the training forward gets reference latents (online or from the latent cache)."""
    return bool(config.ref_vae_path or config.latent_cache_dir)


@dataclass(frozen=True)
class LossPlan:
    """What the training forward decodes and which loss terms ``compute_losses`` computes."""

    decode_own: bool  # the TAE also decodes its own latents (reconstruction and LPIPS need them)
    terms: tuple[str, ...]  # the computed terms, by their logged names


def loss_plan(config: TrainConfig, with_reference: bool) -> LossPlan:
    """The one rule for a forward with or without reference latents: its own latents are
    decoded without them (the reconstruction loss is then all that trains) or when the
    reconstruction loss counts; the terms on decoded frames exist only then."""
    decode_own = not with_reference or config.reconstruction_loss_weight > 0
    terms = ("encoder_loss", "decoder_loss") if with_reference else ()
    if decode_own:
        terms += ("reconstruction_loss",) + (("lpips_loss",) if config.lpips_loss_weight > 0 else ())
    return LossPlan(decode_own, terms)


def config_errors(config: TrainConfig) -> list[str]:
    """What is wrong with the loss weights: the recipe needs at least one loss that trains,
    and no weight may count a term that ``loss_plan`` never computes."""
    found = []
    if (
        config.ref_vae_path
        and config.encoder_loss_weight + config.decoder_loss_weight + config.reconstruction_loss_weight <= 0
    ):
        found.append("all loss weights are 0")
    if not config.ref_vae_path and config.reconstruction_loss_weight <= 0:
        found.append(
            "without a reference VAE only the reconstruction loss trains the model: set reconstruction_loss_weight > 0"
        )
    if config.lpips_loss_weight > 0 or config.best_metric == "val/lpips":
        if (reason := lpips_unavailable_reason()) is not None:
            found.append(f"lpips_loss_weight > 0 or best_metric=val/lpips, but LPIPS is unusable: {reason}")
    if config.lpips_loss_weight > 0 and "lpips_loss" not in loss_plan(config, uses_reference(config)).terms:
        found.append(
            "lpips_loss_weight > 0 needs the TAE's own decoded frames: with a reference VAE they are decoded "
            "only when reconstruction_loss_weight > 0; set reconstruction_loss_weight > 0 or lpips_loss_weight=0"
        )
    return found


def notes(config: TrainConfig, spec: VariantSpec) -> list[str]:
    """What the user should know about what the losses cover (informational)."""
    found, plan = [], spec.plan(config.n_frames)
    if not config.ref_vae_path:
        if not plan.exact:
            exact = spec.exact_frame_counts(64)
            found.append(
                f"n_frames={config.n_frames}: {spec.name} decodes {plan.decoded_frames} frames, so the "
                f"reconstruction loss covers input frames 0..{plan.aligned_frames - 1}; exact values: "
                f"{', '.join(map(str, exact[:8]))}, ..."
            )
        found.append("no reference VAE: plain autoencoder training (encoder/decoder distillation losses off)")
    if not config.train_encoder and config.ref_vae_path and config.encoder_loss_weight > 0:
        found.append("train_encoder=false: the encoder loss is logged but trains nothing (the encoder is frozen)")
    return found


@dataclass(frozen=True)
class LossWeights:
    """What each term counts in the total ``loss``; a term that is not computed counts nothing."""

    encoder: float
    decoder: float
    reconstruction: float
    lpips: float = 0.0

    @classmethod
    def of(cls, config: TrainConfig) -> LossWeights:
        return cls(
            encoder=config.encoder_loss_weight,
            decoder=config.decoder_loss_weight,
            reconstruction=config.reconstruction_loss_weight,
            lpips=config.lpips_loss_weight,
        )


def _mse(pred: torch.Tensor, target: torch.Tensor, what: str) -> torch.Tensor:
    if pred.shape != target.shape:
        raise RuntimeError(
            f"{what}: prediction {tuple(pred.shape)} and target {tuple(target.shape)} differ "
            "(frame arithmetic mismatch; this is a bug, please report it)"
        )
    return F.mse_loss(pred.float(), target.float())


def compute_losses(
    out: AutoencoderOutput,
    targets: torch.Tensor,
    reference_latents: torch.Tensor | None,
    weights: LossWeights,
) -> dict[str, torch.Tensor]:
    """Weighted total ``loss`` plus each term that was computed (unweighted, for logging),
    and the latent RMS ratio to the reference (``common.metrics.rms_ratio``) when there is one."""
    terms: dict[str, tuple[torch.Tensor, float]] = {}
    if reference_latents is not None:
        terms["encoder_loss"] = (_mse(out.latents, reference_latents, "encoder loss"), weights.encoder)
        terms["decoder_loss"] = (_mse(out.decoded_from_reference, targets, "decoder loss"), weights.decoder)
    if out.decoded is not None:
        terms["reconstruction_loss"] = (_mse(out.decoded, targets, "reconstruction loss"), weights.reconstruction)
        if weights.lpips > 0:
            from taehv_train.common.metrics import video_lpips

            terms["lpips_loss"] = (video_lpips(out.decoded, targets).mean(), weights.lpips)
    if not terms:
        raise RuntimeError("no loss term was computed: give reference latents or decode the model's own latents")
    losses = {name: value for name, (value, _) in terms.items()}
    losses["loss"] = sum(weight * value for value, weight in terms.values())
    if reference_latents is not None:  # logged beside the losses (train/latent_rms_ratio), not trained on
        losses["latent_rms_ratio"] = rms_ratio(out.latents, reference_latents)
    return losses
