"""The training step on its own (one CPU process, tiny clips): accumulation windows,
skipping on a non-finite loss or an out-of-memory forward pass, the signal flag, and the
source of reference latents. Multi-process agreement: tests/test_fault_tolerance.py."""
from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from models.taehv import TAEHV
from training.config import TrainConfig
from training.data.loading import ReferenceLatents
from training.loop.resilience import FaultPlan, StopRequest
from training.loop.step import TrainStep

FRAMES, SIZE = 5, 8


def make_step(faults: str = "", stop: StopRequest | None = None, latents: ReferenceLatents | None = None,
              **changes) -> TrainStep:
    config = TrainConfig(variant="taehv", n_frames=FRAMES, height=SIZE, width=SIZE, train_batch_size=1,
                         mixed_precision="no", lr_scheduler="constant", lr_warmup_steps=0, **changes)
    torch.manual_seed(0)
    step, _ = TrainStep.build(config, Accelerator(cpu=True, gradient_accumulation_steps=config.gradient_accumulation_steps),
                              TAEHV(variant="taehv"), latents or ReferenceLatents(None, cached=False),
                              FaultPlan.parse(faults), stop)
    step.model.train()
    return step


def batch(**extra) -> dict:
    return {"frames": torch.randint(0, 256, (1, FRAMES, 3, SIZE, SIZE), dtype=torch.uint8), **extra}


def weights(step: TrainStep) -> list[torch.Tensor]:
    return [p.detach().clone() for p in step.net.parameters()]


def changed(before: list[torch.Tensor], step: TrainStep) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(before, step.net.parameters()))


def test_a_window_of_two_micro_batches_steps_once():
    step = make_step(gradient_accumulation_steps=2)
    before, ema_before = weights(step), [p.clone() for p in step.ema.shadow_params]
    first = step(batch(), window=1)
    assert not first.window_done and first.losses is not None and not changed(before, step)
    second = step(batch(), window=1)
    assert second.window_done and second.applied and second.skip_reason is None
    assert changed(before, step) and bool(torch.isfinite(torch.as_tensor(second.grad_norm)))
    assert any(not torch.equal(a, b) for a, b in zip(ema_before, step.ema.shadow_params))
    assert set(second.losses) == {"loss", "reconstruction_loss"} and not second.stop_requested


def test_a_non_finite_loss_skips_the_window_and_leaves_the_weights():
    step = make_step(faults="nan_loss@1")
    before, ema_before = weights(step), [p.clone() for p in step.ema.shadow_params]
    result = step(batch(), window=1)
    assert result.window_done and not result.applied and result.skip_reason == "non-finite loss"
    assert result.losses is None and not changed(before, step)
    assert all(torch.equal(a, b) for a, b in zip(ema_before, step.ema.shadow_params))
    assert all(p.grad is None for p in step.net.parameters())  # nothing leaks into the next window
    assert step(batch(), window=2).applied


def test_an_out_of_memory_forward_pass_runs_the_placeholder_and_skips(monkeypatch):
    step = make_step()
    calls = []
    real_forward = step.forward

    def forward(frames, z_ref):
        calls.append(tuple(frames.shape))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("simulated")
        return real_forward(frames, z_ref)

    monkeypatch.setattr(step, "forward", forward)
    before = weights(step)
    result = step(batch(), window=1)
    assert calls == [(1, FRAMES, 3, SIZE, SIZE), (1, FRAMES, 3, 8, 8)]  # the batch, then the placeholder clip
    assert not result.applied and result.skip_reason == "out of memory" and not changed(before, step)


def test_a_signal_is_reported_at_the_step_boundary():
    stop = StopRequest()
    step = make_step(stop=stop)
    stop.signal_name = "SIGTERM"  # what the handler records
    result = step(batch(), window=1)
    assert result.applied and result.stop_requested  # the step finishes; the loop then saves and stops


def test_cached_reference_latents_come_from_the_batch():
    step = make_step(latents=ReferenceLatents(None, cached=True))
    z_ref = torch.randn(1, TAEHV(variant="taehv").plan(FRAMES).latent_frames, 16, 1, 1)
    result = step(batch(latents=z_ref), window=1)
    assert {"encoder_loss", "decoder_loss", "reconstruction_loss"} <= set(result.losses)
    with pytest.raises(KeyError):  # a cache-fed step never falls back to something else
        step(batch(), window=2)


def test_validation_runs_the_model_in_bf16_and_the_metrics_in_fp32(demo_clips, monkeypatch):
    """Under bf16 autocast the metrics' own convolutions (SSIM's window, the sharpness
    Laplacian) would run in bf16 too: 0.43 instead of 0.62 SSIM was seen for the same weights."""
    from training.data.loading import build_datasets
    from training.loop import validation

    config = TrainConfig(variant="taehv", n_frames=FRAMES, height=16, width=16, data_root=str(demo_clips["root"]),
                         annotation_file=str(demo_clips["train"]), val_annotation_file=str(demo_clips["val"]),
                         num_validation_samples=1, mixed_precision="bf16")
    autocast_during = {}
    for name in ("video_ssim", "video_sharpness", "video_psnr"):
        metric = getattr(validation, name)
        monkeypatch.setattr(validation, name, lambda p, t, metric=metric, name=name: (
            autocast_during.setdefault(name, torch.is_autocast_enabled("cpu")), metric(p, t))[1])
    decoder_dtypes = []
    model = TAEHV(variant="taehv")
    model.decoder[-1].register_forward_hook(lambda module, args, out: decoder_dtypes.append(out.dtype))
    AcceleratorState._reset_state(reset_partial_state=True)  # a bf16 Accelerator after this file's fp32 ones
    try:
        metrics = validation.validate(Accelerator(cpu=True, mixed_precision="bf16"), model, build_datasets(config)[1],
                                      config, None, torch.float32)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert decoder_dtypes == [torch.bfloat16] and autocast_during == dict.fromkeys(autocast_during, False)
    assert len(autocast_during) == 3 and 0 < metrics["val/ssim"] <= 1
