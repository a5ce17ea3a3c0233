"""The Accelerator a training run uses, and each process's logging.

Accumulation and gradient clipping come from the Python config only: an accelerate YAML
that sets them otherwise is refused. The step decides where its accumulation windows end
(``accumulation_plugin``, ``training.loop.step.TrainStep.accumulate``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, InitProcessGroupKwargs

from taehv_train.base.errors import UserError
from taehv_train.common.config import TrainConfig
from taehv_train.training.loop.distributed import process_group_backend, skip_unused_deepspeed_kernels
from taehv_train.training.loop.trackers import log_with


def accumulation_plugin(config: TrainConfig) -> GradientAccumulationPlugin:
    """Windows of ``gradient_accumulation_steps`` micro-batches whose ends the step decides
    (``training.loop.step.TrainStep.accumulate``), for the Accelerator that runs it."""
    return GradientAccumulationPlugin(num_steps=config.gradient_accumulation_steps, sync_with_dataloader=False)


def make_accelerator(config: TrainConfig, run_dir: Path) -> Accelerator:
    """Accelerator whose accumulation and clipping come from the Python config only."""
    for env, value in (
        ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", config.gradient_accumulation_steps),
        ("ACCELERATE_GRADIENT_CLIPPING", config.max_grad_norm),
    ):
        given = os.environ.get(env)
        if given not in (None, "auto") and float(given) != float(value):
            raise UserError(
                f"the accelerate config sets {env.removeprefix('ACCELERATE_').lower()}={given} but the training "
                f"config says {value}: remove it from the accelerate YAML (the Python config is the single source)"
            )
        os.environ[env] = str(value)  # DeepSpeed's plugin reads these
    backend = process_group_backend()
    skip_unused_deepspeed_kernels()  # when the Accelerator makes the process group
    return Accelerator(
        gradient_accumulation_plugin=accumulation_plugin(config),
        # no RNG broadcast at each epoch's start: the prefetching thread starts epochs, and a collective
        # there would race the step's; the sampler and the clips' draws are seeded by the epoch on every rank
        rng_types=[],
        mixed_precision=config.mixed_precision,
        log_with=log_with(config, run_dir),
        project_dir=str(run_dir),
        kwargs_handlers=[InitProcessGroupKwargs(backend=backend)] if backend else [],
        # pinned batches copied asynchronously to the GPU (the loader pins them on CUDA)
        dataloader_config=DataLoaderConfiguration(
            non_blocking=torch.cuda.is_available()
        ),  # device is cuda iff available
    )


def setup_logging(run_dir: Path, accelerator: Accelerator) -> None:
    """Every process logs its warnings to stderr, each line naming its rank; the main
    process logs its information too, also to ``train.log`` in the run directory."""
    level = logging.INFO if accelerator.is_main_process else logging.WARNING
    handlers = [logging.StreamHandler()]
    if accelerator.is_main_process:
        handlers.append(logging.FileHandler(run_dir / "train.log"))
    logging.basicConfig(
        level=level,
        handlers=handlers,
        force=True,
        format=f"%(asctime)s [rank {accelerator.process_index}] %(levelname)s %(name)s: %(message)s",
    )
