"""What the step asks of DeepSpeed's engine before it trains (training/loop/deepspeed_engine.py):
the overflow check in the config it builds, and a one-line refusal of an engine it cannot
drive or that could apply a non-finite window. The engine's behaviour itself runs under
2-process ZeRO-2 in tests/test_zero2_faults.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from taehv_train.base.errors import UserError
from taehv_train.training.loop import deepspeed_engine


def engine(stage: int = 2, bf16: bool = True, **optimizer) -> SimpleNamespace:
    """An object with the engine methods the check reads."""
    return SimpleNamespace(
        zero_optimization_stage=lambda: stage,
        bfloat16_enabled=lambda: bf16,
        optimizer=SimpleNamespace(**optimizer),
    )


def test_a_zero2_engine_with_its_overflow_check_is_taken():
    deepspeed_engine.check_engine(engine(check_grad_overflow=True))
    deepspeed_engine.check_engine(engine(bf16=False, check_grad_overflow=False))  # fp16 always checks; fp32 by norm


@pytest.mark.parametrize(
    ("refused", "words"),
    [
        (engine(stage=3, check_grad_overflow=True), "ZeRO stage 3"),
        (engine(stage=0, check_grad_overflow=True), "ZeRO stage 0"),
        (engine(), "install deepspeed>=0.17.1"),  # an older DeepSpeed: no check_grad_overflow
        (engine(check_grad_overflow=False), "bf16.check_grad_overflow=false"),
    ],
)
def test_an_engine_the_step_cannot_drive_is_refused_in_one_line(refused, words):
    with pytest.raises(UserError, match=words) as caught:
        deepspeed_engine.check_engine(refused)
    assert "\n" not in str(caught.value)


def test_the_config_asks_for_the_bf16_overflow_check():
    config = {"bf16": {"enabled": True}, "fp16": {"enabled": False}}
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config)))
    deepspeed_engine.turn_on_overflow_check(accelerator)
    assert config["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert config["fp16"] == {"enabled": False}  # fp16 checks whatever the config says
    deepspeed_engine.turn_on_overflow_check(SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None)))  # no DS


def test_dropping_a_window_the_engine_applies_anyway_is_an_error():
    """The drop switches the check on for its one call and puts the setting back; an engine
    that still applies the window (finite gradients) is not carried on silently."""
    seen = []
    optimizer = SimpleNamespace(check_grad_overflow=False)
    applies = SimpleNamespace(
        optimizer=optimizer, step=lambda: seen.append(optimizer.check_grad_overflow), was_step_applied=lambda: True
    )
    with pytest.raises(RuntimeError, match="DeepSpeed applied a window"):
        deepspeed_engine.drop(applies)
    assert seen == [True] and optimizer.check_grad_overflow is False
    skips = SimpleNamespace(optimizer=optimizer, step=lambda: None, was_step_applied=lambda: False)
    deepspeed_engine.drop(skips)
