"""The training step on its own (one CPU process, tiny clips): accumulation windows and
the epochs they follow, the gradients handed to the optimizer, skipping on a non-finite
loss, an out-of-memory forward or backward pass or a backward compilation that fails, a
compiled forward retried eagerly, an out-of-memory optimizer step, a batch that cannot be
loaded, the signal flag, and the source of reference latents.
Multi-process agreement: tests/test_fault_tolerance.py."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader, Dataset

from conftest import demo_validation_config
from taehv_train.common.clips import VideoDataError
from taehv_train.models.taehv import TAEHV
from taehv_train.training.data.loading import ReferenceLatents
from taehv_train.training.data.prefetch import BatchOutOfMemory, Prefetcher, WaitInterrupted
from taehv_train.training.loop.progress import Progress
from taehv_train.training.loop.resilience import StopRequest
from taehv_train.training.loop.step import OptimizerStepFailed, TrainStep
from train_runs import tiny_train_step

FRAMES, SIZE = 5, 8


def make_step(
    faults: str = "", stop: StopRequest | None = None, latents: ReferenceLatents | None = None, **changes
) -> TrainStep:
    return tiny_train_step(FRAMES, SIZE, faults, stop, latents, **changes)[0]


def batch(**extra) -> dict:
    return {"frames": torch.randint(0, 256, (1, FRAMES, 3, SIZE, SIZE), dtype=torch.uint8), **extra}


def weights(train_step: TrainStep) -> list[torch.Tensor]:
    return [p.detach().clone() for p in train_step.unwrapped_model.parameters()]


def changed(before: list[torch.Tensor], train_step: TrainStep) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(before, train_step.unwrapped_model.parameters()))


def test_a_window_of_two_micro_batches_steps_once():
    """One call takes the window's micro-batches one at a time, steps once at the end and
    asks for no batch beyond the window."""
    train_step = make_step(gradient_accumulation_steps=2)
    before, ema_before = weights(train_step), [p.clone() for p in train_step.ema.shadow_params]
    unchanged_between = []

    def two_batches():
        yield batch(failures=torch.tensor([1]))
        unchanged_between.append(not changed(before, train_step))  # the first backward pass, no step yet
        yield batch(failures=torch.tensor([0]))
        raise AssertionError("a third micro-batch was asked for")

    result = train_step(two_batches(), window=1)
    assert unchanged_between == [True] and result.micro_batches == 2 and len(result.losses) == 2
    assert result.applied and result.skip_reason is None and not result.data_failed
    assert changed(before, train_step) and bool(torch.isfinite(torch.as_tensor(result.grad_norm)))
    assert any(not torch.equal(a, b) for a, b in zip(ema_before, train_step.ema.shadow_params))
    assert set(result.losses[1]) == {"loss", "reconstruction_loss"} and not result.stop_requested
    assert int(result.failures) == 1 and result.data_wait >= 0


def test_a_non_finite_loss_skips_the_window_and_leaves_the_weights():
    train_step = make_step(faults="nan_loss@1")
    before, ema_before = weights(train_step), [p.clone() for p in train_step.ema.shadow_params]
    result = train_step(iter([batch()]), window=1)
    assert not result.applied and result.skip_reason == "non-finite loss"
    assert result.losses == [] and not changed(before, train_step)
    assert all(torch.equal(a, b) for a, b in zip(ema_before, train_step.ema.shadow_params))
    assert all(p.grad is None for p in train_step.unwrapped_model.parameters())  # nothing leaks into the next window
    assert train_step(iter([batch()]), window=2).applied


def test_an_out_of_memory_forward_pass_skips_the_window_without_a_placeholder(monkeypatch):
    """One process has no collective to meet: the rank hands over NaN gradients, no
    placeholder clip runs (a shape nothing else compiles)."""
    train_step = make_step()
    calls = []
    real_forward = train_step.forward

    def forward(frames, z_ref):
        calls.append(tuple(frames.shape))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("simulated")
        return real_forward(frames, z_ref)

    monkeypatch.setattr(train_step, "forward", forward)
    before = weights(train_step)
    result = train_step(iter([batch()]), window=1)
    assert calls == [(1, FRAMES, 3, SIZE, SIZE)]
    assert not result.applied and result.skip_reason == "out of memory" and not changed(before, train_step)
    assert all(p.grad is None for p in train_step.unwrapped_model.parameters())
    assert train_step(iter([batch()]), window=2).applied


def test_an_out_of_memory_backward_pass_skips_the_window():
    train_step = make_step(faults="oom_backward@1", gradient_accumulation_steps=2)
    before, ema_before = weights(train_step), [p.clone() for p in train_step.ema.shadow_params]
    result = train_step(iter([batch(), batch()]), window=1)
    assert not result.applied and result.skip_reason == "out of memory" and result.micro_batches == 2
    assert not changed(before, train_step) and result.losses == []
    assert all(torch.equal(a, b) for a, b in zip(ema_before, train_step.ema.shadow_params))
    assert all(p.grad is None for p in train_step.unwrapped_model.parameters())
    assert train_step(iter([batch(), batch()]), window=2).applied


def test_the_handed_over_gradients_are_the_losses_own(monkeypatch):
    """The optimizer sees exactly the gradients a plain backward pass of the window's mean
    loss gives (two micro-batches: each counts half)."""
    train_step = make_step(gradient_accumulation_steps=2)
    twin = TAEHV(variant="taehv")
    twin.load_state_dict(train_step.unwrapped_model.state_dict())
    batches = [batch(), batch()]
    for item in batches:
        frames = item["frames"].float() / 255
        out = twin(frames, None, decode_own=True)
        target = twin.plan(FRAMES).target(frames)
        (torch.nn.functional.mse_loss(out.decoded, target) / 2).backward()
    seen = []
    monkeypatch.setattr(
        train_step.optimizer, "step", lambda *a, **k: seen.extend(p.grad.clone() for p in train_step.trainable)
    )
    assert train_step(iter(batches), window=1).applied
    expected = [p.grad for p in twin.parameters()]
    assert len(seen) == len(expected)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(seen, expected))


def test_a_backward_compilation_that_fails_skips_the_window_and_leaves_the_model_eager(caplog):
    train_step = make_step(faults="compile_backward@1", compile="true", compile_backend="aot_eager")
    assert train_step.unwrapped_model.compiled
    before = weights(train_step)
    result = train_step(iter([batch()]), window=1)
    assert not result.applied and result.skip_reason == "torch.compile failed in the backward pass"
    assert not changed(before, train_step) and not train_step.unwrapped_model.compiled
    assert [r for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert train_step(iter([batch()]), window=2).applied  # eager from now on


def test_a_compiled_forward_that_fails_is_run_again_eagerly_at_once():
    """A failure the model's own fallback does not see (a plain exception, as dynamo's
    recompile limit raises under fullgraph) is retried eagerly: the window is applied."""
    train_step = make_step()
    model = train_step.unwrapped_model
    eager = model.run_blocks

    def fails(*args, **kwargs):
        raise RuntimeError("recompile limit reached")

    model.run_blocks = fails  # stands for the compiled blocks
    assert model.compiled
    result = train_step(iter([batch()]), window=1)
    assert result.applied and model.run_blocks is eager


def test_an_out_of_memory_optimizer_step_ends_the_run():
    train_step = make_step(faults="oom_step@1")
    with pytest.raises(OptimizerStepFailed, match="out of memory in the optimizer step of window 1"):
        train_step(iter([batch()]), window=1)


def test_an_out_of_memory_copy_to_the_device_skips_the_window():
    train_step = make_step(gradient_accumulation_steps=2)
    before = weights(train_step)
    result = train_step(iter([batch(), BatchOutOfMemory("out of memory in the copy of batch 2")]), window=1)
    assert not result.applied and result.skip_reason == "out of memory" and not result.data_failed
    assert result.micro_batches == 2 and not changed(before, train_step)
    assert train_step(iter([batch(), batch()]), window=2).applied


def test_a_stop_while_waiting_for_a_batch_drops_the_window_to_give_it_back():
    stop = StopRequest()
    train_step = make_step(stop=stop, gradient_accumulation_steps=2)
    stop.signal_name = "SIGTERM"
    waited = WaitInterrupted("a stop was requested while this process waited for its next batch")
    before = weights(train_step)
    result = train_step(iter([batch(), waited]), window=1)
    assert result.data_failed and result.stop_requested and result.micro_batches == 2  # given back, then saved
    assert not result.applied and not changed(before, train_step)


def test_a_signal_is_reported_at_the_step_boundary():
    """A signal in the first micro-batch does not cut the window short: its step is taken."""
    stop = StopRequest()
    train_step = make_step(stop=stop, gradient_accumulation_steps=2)
    stop.signal_name = "SIGTERM"  # what the handler records
    result = train_step(iter([batch(), batch()]), window=1)
    assert result.applied and result.micro_batches == 2 and result.stop_requested  # the loop then saves and stops


def test_a_batch_that_cannot_be_loaded_drops_the_window():
    """The rank whose data is gone hands over NaN gradients to the window's end (so that its
    gradient collectives meet the other ranks'); no optimizer step for the window; the loop
    saves the last step and stops."""
    train_step = make_step(gradient_accumulation_steps=3)
    before, error = weights(train_step), VideoDataError("the clips are gone")
    shapes = []
    real_forward = train_step.forward
    train_step.forward = lambda frames, z_ref: shapes.append(frames.shape[-1]) or real_forward(frames, z_ref)
    result = train_step(iter([batch(), error, batch()]), window=1)
    assert result.data_failed and result.data_error is error and result.micro_batches == 3
    assert shapes == [SIZE]  # the batch; NaN gradients for the lost one and the rest of the window
    assert not result.applied and result.skip_reason is None and result.grad_norm is None and result.losses == []
    assert not changed(before, train_step)
    assert all(p.grad is None for p in train_step.unwrapped_model.parameters())


class Clips(Dataset):
    """Tiny clips in order; clip ``missing`` cannot be read from its second reading on, as
    when the files are deleted during the second epoch."""

    def __init__(self, count: int, missing: int):
        self.count, self.missing, self.reads = count, missing, 0

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict:
        if index == self.missing:
            self.reads += 1
            if self.reads > 1:
                raise VideoDataError(f"clip {index} is gone")
        return {"frames": torch.full((FRAMES, 3, SIZE, SIZE), index, dtype=torch.uint8), "failures": 0}


def test_windows_follow_the_epochs_and_a_failed_one_is_given_back():
    """A window ends at its epoch's last batch: windows of 2 over 5 batches take 2, 2 and 1
    of them, and the next epoch starts with the next window. The run's position counts the
    batches taken, not those the prefetching thread fetched ahead; a window whose batch
    cannot be loaded gives them back."""
    train_step = make_step(gradient_accumulation_steps=2)
    progress = Progress()
    loader = train_step.accelerator.prepare(DataLoader(Clips(5, missing=4), batch_size=1))
    batches = Prefetcher(loader, train_step.accelerator, progress)
    try:
        seen = []
        for _ in range(5):
            result = train_step(batches, progress.next_window)
            progress.count(result)
            seen.append((result.micro_batches, progress.epoch, progress.batch_in_epoch, progress.step))
        # the loader reads one batch ahead: clip 4 of epoch 1 fails the batch of clip 3, the window's second
        assert seen == [(2, 0, 2, 1), (2, 0, 4, 2), (1, 0, 5, 3), (2, 1, 2, 4), (2, 1, 2, 4)]
        assert result.data_failed and progress.skipped_steps == 0
    finally:
        batches.close()
        GradientState._reset_state()  # the loader that failed is still registered as iterating


def test_cached_reference_latents_come_from_the_batch():
    train_step = make_step(latents=ReferenceLatents(None, cached=True))
    z_ref = torch.randn(1, TAEHV(variant="taehv").plan(FRAMES).latent_frames, 16, 1, 1)
    result = train_step(iter([batch(latents=z_ref)]), window=1)
    assert {"encoder_loss", "decoder_loss", "reconstruction_loss"} <= set(result.losses[0])
    with pytest.raises(KeyError):  # a cache-fed step never falls back to something else
        train_step(iter([batch()]), window=2)


def test_validation_runs_the_model_in_bf16_and_the_metrics_in_fp32(demo_clips, monkeypatch):
    """Under bf16 autocast the metrics' own convolutions (SSIM's window, the sharpness
    Laplacian) would run in bf16 too: 0.43 instead of 0.62 SSIM was seen for the same weights."""
    from taehv_train.common import metrics as reconstruction
    from taehv_train.common import preview_score
    from taehv_train.training.data.loading import build_datasets
    from taehv_train.training.loop import validation

    config = demo_validation_config(demo_clips, n_frames=FRAMES, mixed_precision="bf16")
    autocast_during = {}
    for module, name in (
        *((reconstruction, name) for name in ("video_ssim", "video_sharpness", "video_psnr")),
        *((preview_score, name) for name in ("video_ssim", "video_psnr")),  # the preview score's
    ):
        metric = getattr(module, name)
        monkeypatch.setattr(
            module,
            name,
            lambda p, t, metric=metric, key=f"{module.__name__}.{name}": (
                autocast_during.setdefault(key, torch.is_autocast_enabled("cpu")),
                metric(p, t),
            )[1],
        )
    decoder_dtypes = []
    model = TAEHV(variant="taehv")
    model.decoder[-1].register_forward_hook(lambda module, args, out: decoder_dtypes.append(out.dtype))
    AcceleratorState._reset_state(reset_partial_state=True)  # a bf16 Accelerator after this file's fp32 ones
    try:
        metrics = validation.validate(
            Accelerator(cpu=True, mixed_precision="bf16"), model, build_datasets(config)[1], config, None, torch.float32
        )
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert decoder_dtypes == [torch.bfloat16] * 2  # the whole clip, then its first latent alone (the preview)
    assert autocast_during == dict.fromkeys(autocast_during, False)
    assert len(autocast_during) == 5 and 0 < metrics["val/ssim"] <= 1 and 0 < metrics["val/preview_ssim"] <= 1
