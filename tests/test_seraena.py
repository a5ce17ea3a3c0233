"""Seraena: discriminator shapes, replay buffer, that its corrections point towards the real
data, exact resume through safetensors, and identical discriminators across gloo ranks."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from taehv_train.base.ports import free_port
from taehv_train.models.seraena import Seraena


def batch(
    g: int, channels: int, size: int, ctx_channels: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    real = torch.rand(g, channels, size, size, generator=gen)
    fake = torch.rand(g, channels, size, size, generator=gen)
    ctx = torch.randn(g, ctx_channels, size // 8, size // 8, generator=gen)
    return real, fake, ctx


def test_shapes_dtypes_and_parameter_count():
    seraena = Seraena(9, 16)
    # convs 25*64*9 + 64*128*16 + 128*256*16 + 256*512*16 + 2*512*512*9, GroupNorm affine
    # 2*1984, 1x1 heads 1984 weights + 6 biases
    assert sum(p.numel() for p in seraena.parameters()) == 7_491_462
    real, fake, ctx = batch(4, 9, 32, 16, seed=0)
    assert seraena(real, ctx).shape == (4, 6, 4, 4)
    target, stats = seraena.step_and_make_correction_targets(real, fake.bfloat16(), ctx)
    assert target.shape == (4, 9, 32, 32) and target.dtype == torch.bfloat16 and not target.requires_grad
    assert {"disc_loss", "correction_norm"} <= stats.keys()
    for value in stats.values():
        assert value.ndim == 0 and value.is_floating_point() and torch.isfinite(value)
    assert stats["correction_norm"].item() == pytest.approx(1.0, abs=1e-3)  # unit std
    assert (
        seraena.buffer_bytes()
        == Seraena.estimate_buffer_bytes(16384, 9, 16, 32, 32, 4, 4)
        == 16384 * (9 * 1024 + 16 * 16) * 4
    )


def test_buffer_estimate_matches_the_published_figures():
    assert Seraena.estimate_buffer_bytes(16384, 9, 16, 64, 64, 8, 8) / 2**30 == pytest.approx(2.31, abs=0.01)
    assert Seraena.estimate_buffer_bytes(16384, 9, 16, 480, 480, 60, 60) / 2**30 == pytest.approx(130.1, abs=0.1)


def test_batch_norm_variant_steps():
    seraena = Seraena(3, 4, buffer_size=8, norm="batch")
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in seraena.modules())
    target, stats = seraena.step_and_make_correction_targets(*batch(4, 3, 16, 4, seed=1))
    assert target.shape == (4, 3, 16, 16) and torch.isfinite(stats["disc_loss"])


def test_rejects_bad_inputs():
    seraena = Seraena(3, 4, buffer_size=8)
    real, fake, ctx = batch(3, 3, 8, 4, seed=0)
    with pytest.raises(ValueError, match="even"):
        seraena.step_and_make_correction_targets(real, fake, ctx)
    real, fake, ctx = batch(2, 3, 12, 4, seed=0)
    with pytest.raises(ValueError, match="multiples of 8"):
        seraena.step_and_make_correction_targets(real, fake, ctx)
    real, fake, ctx = batch(2, 3, 8, 5, seed=0)
    with pytest.raises(ValueError, match="ctx"):
        seraena.step_and_make_correction_targets(real, fake, ctx)
    with pytest.raises(ValueError, match="norm"):
        Seraena(3, 4, norm="layer")


def run_buffer(seed: int) -> tuple[Seraena, list[torch.Tensor]]:
    seraena = Seraena(3, 4, buffer_size=5, seed=seed)
    fills, pushed = [], []
    for step in range(4):
        real, fake, ctx = batch(2, 3, 8, 4, seed=100 + step)
        seraena.step_and_make_correction_targets(real, fake, ctx)
        fills.append(seraena._count)
        pushed.append(fake)
    assert fills == [2, 4, 5, 5]
    return seraena, pushed


def test_replay_buffer_fills_then_replaces_deterministically():
    a, pushed = run_buffer(seed=0)
    b, _ = run_buffer(seed=0)
    c, _ = run_buffer(seed=1)
    assert torch.equal(a._images, b._images) and torch.equal(a._context, b._context)
    samples = torch.cat(pushed)  # every slot holds one of the pushed fakes ...
    assert all(any(torch.equal(slot, s) for s in samples) for slot in a._images)
    assert any(torch.equal(slot, s) for slot in a._images for s in pushed[-1])  # ... the newest included
    assert not torch.equal(a._images[:4], samples[:4])  # the first fakes were partly replaced
    assert not torch.equal(a._images, c._images)  # replacement slots depend on the seed


def smooth_images(g: int, gen: torch.Generator) -> torch.Tensor:
    return F.interpolate(torch.rand(g, 3, 2, 2, generator=gen), size=(8, 8), mode="bilinear", align_corners=False)


def test_toy_problem_discriminator_learns_and_corrections_point_to_real():
    """Real = smooth images, fake = the same images plus noise: the discriminator's loss
    falls, it separates held-out real from fake, and the corrections remove the noise
    (point from fake towards real)."""
    gen = torch.Generator().manual_seed(0)
    seraena = Seraena(3, 3, buffer_size=64)

    def real_and_fake() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        real = smooth_images(8, gen)
        return real, real + 0.5 * torch.randn(real.shape, generator=gen), F.avg_pool2d(real, 8)

    losses, cosines, improvements = [], [], []
    for _ in range(30):
        real, fake, ctx = real_and_fake()
        target, stats = seraena.step_and_make_correction_targets(real, fake, ctx)
        losses.append(stats["disc_loss"].item())
        correction = target - fake
        cosines.append(F.cosine_similarity(correction.flatten(1), (real - fake).flatten(1)).mean().item())
        improvements.append(F.mse_loss(fake, real).item() - F.mse_loss(fake + 0.02 * correction, real).item())
    assert sum(losses[-10:]) / 10 < 0.6 * torch.tensor(losses[:10]).median().item(), losses
    assert sum(cosines[-10:]) / 10 > 0.15, cosines
    assert all(i > 0 for i in improvements[-10:]), improvements
    real, fake, ctx = real_and_fake()
    with torch.no_grad():
        assert seraena(fake, ctx).mean() > seraena(real, ctx).mean() + 0.5


def test_resume_is_bit_identical(tmp_path: Path):
    a = Seraena(3, 4, buffer_size=10, seed=0)
    inputs = [batch(4, 3, 8, 4, seed=step) for step in range(5)]
    for real, fake, ctx in inputs[:2]:  # the buffer holds 8 of 10 samples when saved
        a.step_and_make_correction_targets(real, fake, ctx)
    save_file(a.training_state(), str(tmp_path / "seraena.safetensors"))

    b = Seraena(3, 4, buffer_size=10, seed=7)  # another seed: everything must come from the state
    assert not torch.equal(a.discriminator.blocks[0][0].weight, b.discriminator.blocks[0][0].weight)
    b.load_training_state(load_file(str(tmp_path / "seraena.safetensors")))
    for real, fake, ctx in inputs[2:]:  # it fills up, then replaces: both use the restored RNG
        target_a, stats_a = a.step_and_make_correction_targets(real, fake, ctx)
        target_b, stats_b = b.step_and_make_correction_targets(real, fake, ctx)
        assert torch.equal(target_a, target_b)
        assert torch.equal(stats_a["disc_loss"], stats_b["disc_loss"])
    state_a, state_b = a.training_state(), b.training_state()
    assert state_a.keys() == state_b.keys()
    for name, value in state_a.items():
        assert torch.equal(value, state_b[name]), name


def test_load_training_state_is_strict():
    seraena = Seraena(3, 4, buffer_size=6)
    state = seraena.training_state()
    with pytest.raises(ValueError, match="not a Seraena training state"):
        seraena.load_training_state({**state, "extra": torch.zeros(1)})
    state["buffer.count"] = torch.tensor(7)
    with pytest.raises(ValueError, match="buffer_size"):
        seraena.load_training_state(state)


def _rank_worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        seraena = Seraena(3, 4, buffer_size=8, seed=rank)  # different seeds: rank 0's weights must win
        for step in range(2):  # different data on each rank
            seraena.step_and_make_correction_targets(*batch(4, 3, 8, 4, seed=1000 * rank + step))
        weights = {k: v.contiguous() for k, v in seraena.discriminator.state_dict().items()}
        save_file(weights, f"{out_dir}/rank{rank}.safetensors")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_keep_identical_discriminators(tmp_path: Path):
    context = mp.spawn(_rank_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the 2-process Seraena run did not finish in 120 s (collectives out of step?)")
    rank0, rank1 = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1))
    initial = Seraena(3, 4, seed=0).discriminator.state_dict()
    assert rank0.keys() == rank1.keys()
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    assert not torch.equal(rank0["blocks.0.0.weight"], initial["blocks.0.0.weight"])  # it did train
