"""The pre-flight's estimates of one step: its activations (training/loop/memory.py) and the
frames per second the loader must feed one GPU (training/loop/feed.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from taehv_train.base.errors import UserError
from taehv_train.common.config import load_config
from taehv_train.models.taehv import TAEHV
from taehv_train.training.loop import feed, memory


def saved_on_cpu(variant: str, frames: int, with_reference: bool, train_encoder: bool) -> int:
    """What a real forward on the CPU keeps for the backward pass, by storage."""
    torch.manual_seed(0)
    net = TAEHV(variant=variant)
    net.encoder.requires_grad_(train_encoder)
    clips = torch.rand(1, frames, 3, 32, 32)
    with torch.no_grad():
        reference = net.encode_video(clips) if with_reference else None
    kept = {}

    def keep(tensor):
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        net(clips, reference, decode_own=True)
    return sum(kept.values())


@pytest.mark.parametrize(
    "variant, with_reference, train_encoder", [("taehv", False, True), ("taehv", True, False), ("taeh3", True, True)]
)
def test_the_estimate_is_what_a_real_forward_keeps(variant, with_reference, train_encoder):
    """The meta-device forward keeps the storages a real one does: both decodes with
    reference latents, no encoder activations when it is frozen. Within 1%: on a CPU,
    oneDNN turns the folded TPool convolutions' outputs channels-last (their derived
    weights are), so stacking the next frames on channels makes a copy there and a view
    on the meta device."""
    frames = 22 if variant == "taeh3" else 9
    estimate = memory.activation_bytes(variant, 1, frames, 32, 32, torch.float32, with_reference, True, train_encoder)
    assert estimate == pytest.approx(saved_on_cpu(variant, frames, with_reference, train_encoder), rel=0.01)


def test_a_step_that_cannot_fit_is_refused_with_its_size_and_a_close_one_is_warned(monkeypatch):
    config = load_config("training/configs/taehv_config_test.py", [])
    needed = memory.step_bytes(config)
    monkeypatch.setattr(memory, "device_memory", lambda: ("the test device", int(needed * 1.2)))
    assert "may run out of memory" in memory.check_fits(config)[0]
    monkeypatch.setattr(memory, "device_memory", lambda: ("the test device", needed - 1))
    with pytest.raises(
        UserError,
        match=r"^one training step keeps about [0-9.]+ .iB of activations \(1 clip\(s\) "
        r"of 9 frames at 32x32, taecvx, fp32\), more than the [0-9.]+ .iB of the "
        r"test device: lower height and width",
    ):
        memory.check_fits(config)
    monkeypatch.setattr(memory, "device_memory", lambda: ("the test device", needed * 2))
    assert "may run out of memory" not in memory.check_fits(config)[0]


def test_the_h100_preset_needs_about_24_gib_of_activations(monkeypatch):
    """The H100 presets' recipe (2 clips of 17 frames at 480x720, bf16), estimated as on the GPU it
    is for (the published blocks; a CPU's training schedule keeps less): fits an 80 GB GPU,
    which is what the check compares it with there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    memory.activation_bytes.cache_clear()
    try:
        needed = memory.step_bytes(load_config("training/configs/taehv_config_h100.py", []))
    finally:
        memory.activation_bytes.cache_clear()
    assert 20 * 2**30 < needed < 28 * 2**30


def test_the_flops_counted_on_the_meta_device_are_a_real_forwards():
    torch.manual_seed(0)
    net = TAEHV(variant="taecvx").to(torch.bfloat16)
    clips = torch.rand(1, 9, 3, 32, 32, dtype=torch.bfloat16)
    with FlopCounterMode(display=False) as counter:
        net(clips, None, decode_own=True)
    assert feed.forward_flops("taecvx", 1, 9, 32, 32, False, True) == counter.get_total_flops() > 0


def test_the_loader_feed_warning_names_the_workers_one_gpu_needs():
    # the plain autoencoder: the fastest step, the most frames per second to feed
    config = load_config("training/configs/taehv_config_1gpu_h100.py", ["--ref_vae_path=", "--pretrained_model_path="])
    h200 = ("H200", feed.GPU_PEAKS["NVIDIA H200"].bf16_flops)
    (note,) = feed.feed_notes(config, h200)
    assert "may not keep up" not in note and "8 loader worker(s)" in note
    (warning,) = feed.feed_notes(config.replace(dataloader_num_workers=2), h200)
    assert warning.startswith("the loader may not keep up") and "dataloader_num_workers=4 or more" in warning
    assert feed.feed_notes(config.replace(mixed_precision="no"), h200) == []  # no bf16 peak to go by
    # the estimate follows the GPU's peak and the work per frame
    a800 = feed.GPU_PEAKS["NVIDIA A800-SXM4-80GB"].bf16_flops
    assert feed.step_frames_per_second(config, a800) < feed.step_frames_per_second(config, 989e12) / 3
    distilled = config.replace(ref_vae_path="x", reconstruction_loss_weight=1.0)  # two decodes per clip
    assert feed.step_frames_per_second(distilled, 989e12) < feed.step_frames_per_second(config, 989e12)


def test_frame_caches_larger_than_the_machines_ram_are_refused_with_the_numbers(tmp_path, monkeypatch):
    """``frame_cache_mb`` is per loader process: 100 TB each, times the workers of each
    training process on this machine, is refused before anything loads; a cache that fits
    passes."""
    from conftest import valid_config

    config = valid_config(tmp_path, frame_cache_mb=100_000_000, dataloader_num_workers=4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(
        UserError,
        match=r"^frame_cache_mb=100000000 \(97656\.25 GiB per loader process\) x 4 loader process\(es\) "
        r"\(dataloader_num_workers\) x 2 training process\(es\) on this machine is 781250\.00 GiB, more than its "
        r"[0-9.]+ GiB of RAM: lower frame_cache_mb well below [0-9]+, which alone would fill it",
    ):
        memory.check_fits(config)
    monkeypatch.setattr(memory, "host_memory", lambda: 8 << 30)
    with pytest.raises(UserError, match=r"x 1 loader process\(es\) .* lower frame_cache_mb well below 4096,"):
        memory.check_fits(config.replace(frame_cache_mb=4097, dataloader_num_workers=0))
    memory.check_host_memory(config.replace(frame_cache_mb=512))  # 0.5 GiB x 4 x 2 and the batches fit 8 GiB
