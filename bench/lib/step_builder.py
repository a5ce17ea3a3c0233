"""The training loop's step built as the loop builds it, in one process with a plain
Accelerator, for the CPU benchmarks that time it (bench/bench_train_step.py,
bench/bench_compile.py). The GPU benchmarks time the engine a GPU run uses (DeepSpeed
ZeRO-2, started as training starts): bench/lib/on_device_step.py.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

from taehv_train.common.config import TrainConfig
from taehv_train.models.taehv import TAEHV
from taehv_train.training.data.loading import ReferenceLatents
from taehv_train.training.loop.accelerator import accumulation_plugin
from taehv_train.training.loop.step import TrainStep


def build_step(
    config: TrainConfig, device: torch.device, latents: ReferenceLatents, loader: DataLoader | None = None
) -> tuple[TrainStep, DataLoader | None]:
    """The training loop's step, built the way the loop builds it (one process), and the
    training ``loader`` prepared with it; its windows are ``config``'s
    ``gradient_accumulation_steps`` micro-batches, and on CUDA the prepared loader copies its
    pinned batches to the GPU asynchronously, as in training (``make_accelerator``)."""
    accelerator = Accelerator(
        cpu=device.type == "cpu",
        mixed_precision=config.mixed_precision,
        gradient_accumulation_plugin=accumulation_plugin(config),
        dataloader_config=DataLoaderConfiguration(non_blocking=device.type == "cuda"),
    )
    step, loader = TrainStep.build(config, accelerator, TAEHV(variant=config.variant), latents, loader=loader)
    step.model.train()
    return step, loader


def train_step(config: TrainConfig, device: torch.device, latents: ReferenceLatents, seraena: bool) -> TrainStep:
    """``build_step`` without a loader (batches handed to the step), with or without Seraena."""
    return build_step(config.replace(use_seraena=seraena), device, latents)[0]
