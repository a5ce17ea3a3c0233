"""The weight files a run writes while it trains: full fp32 state dicts in the published key format.

What gets exported is the EMA weights when they are kept, else the optimizer's fp32 master
weights (DeepSpeed bf16/fp16 keeps the module itself in low precision), under every
distributed mode: ``weights.safetensors`` in each checkpoint
(``training.state.checkpoints.save_checkpoint``), ``best_model/`` and the run's
``final_model.pth`` / ``final_model.safetensors``. The bundle a user takes away is
``training/export.py``'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from taehv_train.models.weights import save_weights
from taehv_train.training.loop.library_seams import unwrapped_model
from taehv_train.training.state.atomic_folders import write_atomically

if TYPE_CHECKING:
    from diffusers.training_utils import EMAModel


def make_ema(params: list[torch.nn.Parameter], decay: float) -> EMAModel:
    """diffusers' EMAModel over fp32 copies of ``params``. diffusers is imported here, on
    first use: its import brings in torch._dynamo (about 2 s of a process's start), which a
    run stopped by its config or data check never needs."""
    from diffusers.training_utils import EMAModel

    return EMAModel([p.detach().float() for p in params], decay=decay)


def fp32_weights(
    accelerator: Accelerator,
    model: torch.nn.Module,
    ema: EMAModel | None,
    frozen: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Full fp32 weights in the published key format: the EMA or master weights of what
    trains, ``frozen`` (fp32, as loaded) for what does not. Under DeepSpeed every rank must
    call this (the master weights are sharded)."""
    net = unwrapped_model(accelerator, model)
    state = {k: v.detach().float() for k, v in net.state_dict().items()}
    trainable = [(name, param) for name, param in net.named_parameters() if param.requires_grad]
    if ema is not None:
        state.update(zip([name for name, _ in trainable], ema.shadow_params))
    elif accelerator.distributed_type == DistributedType.DEEPSPEED:
        from deepspeed.utils import safe_get_full_fp32_param

        for name, param in trainable:
            full = safe_get_full_fp32_param(param)
            if full is None and param.dtype != torch.float32:
                raise RuntimeError(f"cannot recover fp32 master weights of {name} from DeepSpeed")
            state[name] = (param if full is None else full).detach().float()
    state.update(frozen or {})
    return state


def export_weights(
    accelerator: Accelerator,
    model: torch.nn.Module,
    ema: EMAModel | None,
    directory: Path,
    stem: str,
    suffixes: tuple[str, ...] = (".pth", ".safetensors"),
    frozen: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write ``directory/<stem><suffix>`` (call on every rank; the main process writes)."""
    state = fp32_weights(accelerator, model, ema, frozen)
    if accelerator.is_main_process:
        for suffix in suffixes:
            save_weights(unwrapped_model(accelerator, model), directory / f"{stem}{suffix}", state)


def export_best_model(
    accelerator: Accelerator,
    model: torch.nn.Module,
    ema: EMAModel | None,
    run_dir: Path,
    info: dict,
    frozen: dict[str, torch.Tensor] | None = None,
) -> None:
    """Atomically replace ``best_model/`` (weights + ``model_info.json``); every rank calls it."""

    def write(tmp: Path) -> None:
        export_weights(accelerator, model, ema, tmp, "weights", frozen=frozen)
        if accelerator.is_main_process:
            (tmp / "model_info.json").write_text(json.dumps(info, indent=1))

    def expected_bytes() -> int:  # weights.pth + weights.safetensors, fp32
        return (
            8 * sum(v.numel() for v in unwrapped_model(accelerator, model).state_dict().values())
            if accelerator.is_main_process
            else 0
        )

    write_atomically(accelerator, run_dir / "best_model", write, {"step": info["step"]}, expected_bytes=expected_bytes)
