"""The model to train and its training forward: what each micro-batch of ``training.loop.step`` runs.

The forward decodes what ``training.loop.losses.loss_plan`` says and returns the recipe's
losses on frames aligned by the model's FramePlan.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from accelerate import Accelerator

from taehv_train.common.config import TrainConfig
from taehv_train.models.taehv import TAEHV, AutoencoderOutput
from taehv_train.training.loop import library_seams
from taehv_train.training.loop.losses import LossWeights, compute_losses, loss_plan

logger = logging.getLogger(__name__)


def build_model(config: TrainConfig, resumed: bool = False) -> TAEHV:
    """The model to train: published or our weights, or a fresh one whose decoder starts
    from mid-grey frames (``decoder_bias_init``); a resumed run's weights then come from
    its checkpoint. With ``train_encoder=False`` the encoder is frozen as loaded (also on
    resume: its fp32 weights are the ones exported)."""
    if config.pretrained_model_path and (not resumed or not config.train_encoder):
        model = TAEHV(config.pretrained_model_path, variant=config.variant)
        logger.info("initialised from %s", config.pretrained_model_path)
    else:
        model = TAEHV(variant=config.variant)
        with torch.no_grad():  # decoder_bias_init is in [0, 1]; a network with [-1, 1] pixels takes it mapped there
            model.decoder[-1].bias.fill_(
                config.decoder_bias_init * 2 - 1 if model.signed_pixels else config.decoder_bias_init
            )
        if not resumed:
            logger.info("training %s from scratch", config.variant)
    if not config.train_encoder:
        model.encoder.requires_grad_(False)
        logger.info("decoder-only: the encoder is frozen (no gradients, no optimizer state)")
    return model


def frozen_weights(model: TAEHV) -> dict[str, torch.Tensor]:
    """The frozen weights as loaded, in fp32 copies on the host (DeepSpeed casts the module):
    what exports keep of them."""
    return {
        name: p.detach().to("cpu", torch.float32, copy=True)
        for name, p in model.named_parameters()
        if not p.requires_grad
    }


class Forward(NamedTuple):
    out: AutoencoderOutput
    targets: torch.Tensor  # input frames aligned with the decoded frames (FramePlan.target)
    losses: dict[str, torch.Tensor]


def training_forward(
    accelerator: Accelerator,
    model: torch.nn.Module,
    frames: torch.Tensor,
    z_ref: torch.Tensor | None,
    config: TrainConfig,
    input_dtype: torch.dtype,
) -> Forward:
    """The model's forward pass and the recipe's losses; inputs are cast to the weights'
    dtype here, once (DeepSpeed bf16 keeps the module in bf16)."""
    targets = library_seams.unwrapped_model(accelerator, model).plan(frames.shape[1]).target(frames)
    with accelerator.autocast():
        out = model(
            frames.to(input_dtype),
            None if z_ref is None else z_ref.to(input_dtype),
            decode_own=loss_plan(config, z_ref is not None).decode_own,
        )
    losses = compute_losses(out, targets, z_ref, LossWeights.of(config))
    return Forward(out, targets, losses)
