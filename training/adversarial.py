"""Seraena in the training loop: grouping decoded frames, context, corrected targets.

The decoder's frames and their targets are grouped ``n_seraena_frames`` at a time on the
channel axis (``models.frames.group_frames``: nothing trimmed, exactly invertible); the
context of each group is the latent of its clip averaged over time, repeated once per
group of the actual decoded tensor (not of the configured frame count: the seeds' errors
15 and 16). The discriminator is kept out of ``accelerator.prepare`` (DeepSpeed takes one
model per Accelerator: the seeds' error 10) and keeps itself identical across ranks by
all-reducing its gradients.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from models.frames import group_frames, ungroup_frames
from models.seraena import Seraena
from models.taehv import TAEHV
from training.config import TrainConfig

logger = logging.getLogger(__name__)


def build_seraena(config: TrainConfig, net: TAEHV, device: torch.device) -> Seraena:
    """The discriminator for this config, with its replay-buffer memory logged up front."""
    seraena = Seraena(3 * config.n_seraena_frames, net.latent_channels, buffer_size=config.seraena_buffer_size,
                      lr=config.seraena_learning_rate, seed=config.seed).to(device)
    latent_size = (config.height // (8 * net.patch_size), config.width // (8 * net.patch_size))
    buffer = Seraena.estimate_buffer_bytes(config.seraena_buffer_size, 3 * config.n_seraena_frames,
                                           net.latent_channels, config.height, config.width, *latent_size)
    logger.info("Seraena: %.1fM parameters, %d frames per sample, replay buffer of %d samples = %.2f GB on %s",
                sum(p.numel() for p in seraena.parameters()) / 1e6, config.n_seraena_frames,
                config.seraena_buffer_size, buffer / 1e9, device)
    return seraena


def seraena_loss(seraena: Seraena, decoded: torch.Tensor, targets: torch.Tensor, latents: torch.Tensor,
                 group: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One discriminator step, then MSE(decoded, corrected target) for the decoder.

    decoded, targets: (N, T, 3, H, W) aligned by the FramePlan; latents: (N, t, C, h, w).
    """
    frames = decoded.shape[1]
    if targets.shape != decoded.shape:
        raise RuntimeError(f"Seraena: decoded {tuple(decoded.shape)} and targets {tuple(targets.shape)} differ")
    context = latents.detach().float().mean(1).repeat_interleave(frames // group, dim=0)
    corrected, stats = seraena.step_and_make_correction_targets(
        group_frames(targets.float(), group), group_frames(decoded.detach().float(), group), context)
    target = ungroup_frames(corrected, group, frames)
    return F.mse_loss(decoded.float(), target), stats
