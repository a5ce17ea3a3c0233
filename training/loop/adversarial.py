"""Seraena in the training loop: grouping decoded frames, context, corrected targets.

The decoder's frames and their targets are grouped ``n_seraena_frames`` at a time on the
channel axis (``models.frames.group_frames``: nothing trimmed, exactly invertible); the
context of each group is the latent of its clip averaged over time, repeated once per
group of the actual decoded tensor (not of the configured frame count, which can differ).
The discriminator is kept out of ``accelerator.prepare`` (DeepSpeed takes one model per
Accelerator) and keeps itself identical across ranks by
all-reducing its gradients.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from taehv_train.common.config import TrainConfig
from taehv_train.models.frames import group_frames, group_sizes, ungroup_frames
from taehv_train.models.seraena import Seraena
from taehv_train.models.taehv import TAEHV
from taehv_train.models.variants import VariantSpec

logger = logging.getLogger(__name__)


def config_errors(config: TrainConfig, spec: VariantSpec) -> list[str]:
    """What is wrong with the Seraena keys: the group size must divide the decoded frames
    and leave an even number of groups per batch (the discriminator takes halves)."""
    found = []
    if not config.use_seraena:
        return found
    decoded = spec.plan(config.n_frames).decoded_frames
    sizes = group_sizes(decoded)
    even = [g for g in sizes if config.train_batch_size * decoded // g % 2 == 0]
    if config.n_seraena_frames not in sizes:
        found.append(
            f"n_seraena_frames={config.n_seraena_frames} does not divide the {decoded} decoded frames of "
            f"n_frames={config.n_frames} ({spec.name}); frames would be dropped. Valid: {', '.join(map(str, sizes))}"
        )
    elif config.n_seraena_frames not in even:
        found.append(
            f"Seraena splits each batch into halves, so train_batch_size x decoded frames / n_seraena_frames "
            f"({config.train_batch_size} x {decoded} / {config.n_seraena_frames}) must be even: use an "
            f"even train_batch_size" + (f" or n_seraena_frames in {even}" if even else "")
        )
    return found


def build_seraena(config: TrainConfig, net: TAEHV, device: torch.device) -> Seraena:
    """The discriminator for this config, with its replay-buffer memory logged up front."""
    image_channels = net.image_channels * config.n_seraena_frames  # RGB(A) of each frame of a group
    seraena = Seraena(
        image_channels,
        net.latent_channels,
        buffer_size=config.seraena_buffer_size,
        lr=config.seraena_learning_rate,
        seed=config.seed,
    ).to(device)
    latent_size = (config.height // (8 * net.patch_size), config.width // (8 * net.patch_size))
    buffer = Seraena.estimate_buffer_bytes(
        config.seraena_buffer_size, image_channels, net.latent_channels, config.height, config.width, *latent_size
    )
    logger.info(
        "Seraena: %.1fM parameters, %d frames per sample, replay buffer of %d samples = %.2f GB on %s",
        sum(p.numel() for p in seraena.parameters()) / 1e6,
        config.n_seraena_frames,
        config.seraena_buffer_size,
        buffer / 1e9,
        device,
    )
    return seraena


def seraena_loss(
    seraena: Seraena, decoded: torch.Tensor, targets: torch.Tensor, latents: torch.Tensor, group: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One discriminator step, then MSE(decoded, corrected target) for the decoder.

    decoded, targets: (N, T, 3 or 4, H, W) aligned by the FramePlan; latents: (N, t, C, h, w).
    """
    frames = decoded.shape[1]
    if targets.shape != decoded.shape:
        raise RuntimeError(f"Seraena: decoded {tuple(decoded.shape)} and targets {tuple(targets.shape)} differ")
    context = latents.detach().float().mean(1).repeat_interleave(frames // group, dim=0)
    corrected, stats = seraena.step_and_make_correction_targets(
        group_frames(targets.float(), group), group_frames(decoded.detach().float(), group), context
    )
    target = ungroup_frames(corrected, group, frames)
    return F.mse_loss(decoded.float(), target), stats
