"""DeepSpeed's engine driven by the training step: the step, not the engine, decides whether
an accumulation window is applied.

Under DeepSpeed, ``accelerator.backward`` runs ``engine.step()`` inside a window's last
backward pass (Accelerate's ``DeepSpeedEngineWrapper.backward``), before the ranks have
agreed whether the window is clean; holding back ``optimizer.step()`` does nothing there. A
poisoned window (a NaN loss, or the NaN gradients a rank hands over after an out-of-memory
error or lost data) would then be dropped only by DeepSpeed's own overflow check, which for
bf16 exists from DeepSpeed 0.17.1 (deepspeedai/DeepSpeed#6976) and is on by default only
since deepspeedai/DeepSpeed#8035. So the step drives the engine with DeepSpeed's public
accumulation API (``set_gradient_accumulation_boundary``, ``backward``, ``step``,
deepspeedai/DeepSpeed#1588) and, once every rank agreed:

- a clean window: ``engine.step()`` (the overflow check, on in the config this package
  builds, may still skip it: ``was_step_applied``);
- a window to skip: ``drop``, which takes DeepSpeed's overflow path on purpose (its check
  switched on for that one call, whatever the config says): the poisoned gradients are
  cleared, the weights, the optimizer state and the schedule are untouched.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from taehv_train.base.errors import UserError
from taehv_train.training.loop.library_seams import (
    has_overflow_switch,
    overflow_check,
    set_overflow_check,
    wrapped_deepspeed_engine,
)

logger = logging.getLogger(__name__)
MIN_DEEPSPEED = "0.17.1"  # the ZeRO optimizer's check_grad_overflow switch (deepspeedai/DeepSpeed#6976)
ZERO_STAGES = (1, 2)  # the module's parameters whole on every rank: the step runs the module itself


def engine_of(accelerator: Accelerator) -> Any | None:
    """The prepared DeepSpeed engine, or None when the run is not under DeepSpeed."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    return wrapped_deepspeed_engine(accelerator)


def turn_on_overflow_check(accelerator: Accelerator) -> None:
    """Ask DeepSpeed for its gradient overflow check in bf16 (fp16 always checks), before
    ``prepare`` builds the engine: a second guard behind the step's own flags."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and isinstance(plugin.deepspeed_config.get("bf16"), dict):
        plugin.deepspeed_config["bf16"]["check_grad_overflow"] = True


def check_engine(engine: Any) -> None:
    """Refuse, in one line, an engine the step cannot drive or that could apply a poisoned
    window (an older DeepSpeed, ZeRO-3, bf16 with its overflow check switched off)."""
    import deepspeed

    stage = engine.zero_optimization_stage()
    if stage not in ZERO_STAGES:
        raise UserError(
            f"DeepSpeed ZeRO stage {stage}: training runs ZeRO-1 or ZeRO-2 "
            "(accelerate_configs/*.yaml set zero_stage: 2)"
        )
    if not has_overflow_switch(engine):
        raise UserError(
            f"deepspeed {deepspeed.__version__} cannot drop a window whose gradients are not finite: install "
            f"deepspeed>={MIN_DEEPSPEED} (pip install -r requirements.txt)"
        )
    if engine.bfloat16_enabled() and not overflow_check(engine):
        raise UserError(
            "the DeepSpeed config sets bf16.check_grad_overflow=false: remove it (a non-finite gradient would "
            "then be applied to the weights)"
        )


def backward(engine: Any, loss: torch.Tensor, last: bool) -> None:
    """One micro-batch's backward pass; ``last`` ends the window (ZeRO reduces its gradients)."""
    engine.set_gradient_accumulation_boundary(last)
    engine.backward(loss)


def apply(engine: Any) -> bool:
    """The window's optimizer step; False when DeepSpeed's own overflow check skipped it."""
    engine.step()
    return engine.was_step_applied()


def drop(engine: Any) -> None:
    """Discard the window's gradients without touching the weights, the optimizer state or
    the schedule: DeepSpeed's overflow path, taken with its check on for this call. The
    step only drops windows whose gradients it poisoned (NaN on some rank, so on every rank
    after the reduction)."""
    checks = overflow_check(engine)
    set_overflow_check(engine, True)
    try:
        engine.step()
    finally:
        set_overflow_check(engine, checks)
    if engine.was_step_applied():
        raise RuntimeError("DeepSpeed applied a window the ranks had agreed to drop: its gradients were finite")


def switch_off_overflow_check(engine: Any) -> None:
    """For the fault injection that stands for an engine without its own check (tests)."""
    set_overflow_check(engine, False)
    logger.warning("fault_injection: DeepSpeed's own overflow check is off; the step's flags alone skip windows")
