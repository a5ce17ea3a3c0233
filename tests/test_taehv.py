"""Variant selection, strict loading, saving, training forward and streaming."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import taehv_train.models.taehv as taehv_module
from conftest import REPO_ROOT
from taehv_train.models import fast_ops, fast_paths
from taehv_train.models.blocks import MemBlock, SuperMemBlock, WideMemBlock
from taehv_train.models.fast_ops import forward_stacked, with_past
from taehv_train.models.fast_paths import Kind, fused_schedule
from taehv_train.models.taehv import TAEHV
from taehv_train.models.variants import built_name, detect_variant, get_variant, known_variants, split_time
from taehv_train.models.weights import (
    CheckpointMismatchError,
    WeightsError,
    all_finite,
    read_metadata,
    read_state_dict,
    save_weights,
)


@pytest.mark.parametrize(
    "file_name, variant",
    [
        ("taehv.pth", "taehv"),
        ("taew2_1.pth", "taew2_1"),
        ("taecvx.pth", "taecvx"),
        ("my_taecvx_finetune.safetensors", "taecvx"),
        ("taehv1_5.pth", "taehv1_5"),
        ("taew2_2.pth", "taew2_2"),
        ("taehv1_5_super.pth", "taehv1_5_super"),
        ("taew2_2_super.pth", "taew2_2_super"),
        ("taeh3.pth", "taeh3"),
        ("taeltx_2.pth", "taeltx_2"),
        ("taeltx2_3.pth", "taeltx2_3"),
        ("taeltx2_3_wide.pth", "taeltx2_3_wide"),
        ("tae_mochi.pth", "tae_mochi"),
        ("tae_vidtok_c16_s8_t4.pth", "tae_vidtok_c16_s8_t4"),
        ("final_model.pth", None),
    ],
)
def test_variant_from_file_name(file_name, variant):
    assert detect_variant(f"/some/dir/{file_name}") == variant


def _time_axis(name: str) -> tuple:
    spec = get_variant(name)
    return spec.encoder_time_downscale, spec.decoder_time_upscale, spec.is_cogvideox, spec.h3_chunks, spec.causal


def _architecture(name: str) -> tuple:
    return tuple((k, v) for k, v in sorted(dataclasses.asdict(get_variant(name)).items()) if k != "name")


# the super and wide decoders share their base variant's time axis: the full tier checks them too; a
# built TAE whose time axis is a published one's (Cosmos's is LTX's, KVAE's HunyuanVideo's, ...) or an
# earlier built one's (SVD's is Qwen-Image's) adds nothing; a published name whose whole spec equals an
# earlier one's (taew2_1, taeos1_3 and lighttaew2_1 are taehv's, taeltx_2 is taeltx2_3's, lighttaew2_2
# is taew2_2's) builds the same model and runs the same code
PUBLISHED = [name for name in known_variants() if not name.startswith("tae_")]
PUBLISHED_TIME_AXES = {_time_axis(name) for name in PUBLISHED}
SAME_AS_AN_EARLIER = {
    name
    for i, name in enumerate(PUBLISHED)
    if any(_architecture(name) == _architecture(other) for other in PUBLISHED[:i])
}
FIRST_BUILT_OF_A_NEW_AXIS = {
    _time_axis(name): name
    for name in reversed(known_variants())
    if name.startswith("tae_") and _time_axis(name) not in PUBLISHED_TIME_AXES
}.values()
PLAN_VARIANTS = [
    pytest.param(name, marks=pytest.mark.slow) if name.endswith(("_super", "_wide")) else name
    for name in known_variants()
    if (name in PUBLISHED and name not in SAME_AS_AN_EARLIER) or name in FIRST_BUILT_OF_A_NEW_AXIS
]


@torch.no_grad()
@pytest.mark.parametrize("variant", PLAN_VARIANTS)
def test_the_frame_plan_is_what_the_model_does_for_1_to_40_frames(variant):
    """plan(T) for T = 1..40 (five periods of an 8x time axis, into H3's third 17-frame
    chunk; test_frames.py goes to 64 for taehv and taecvx) gives the latent and decoded frame
    counts the model produces, at the smallest valid size; decoded frame i shows input
    frame i (H3's alignment against its VAE: docs/h3_alignment.md)."""
    torch.manual_seed(0)
    model = TAEHV(variant=variant).eval()
    size = 8 * model.patch_size
    x = torch.rand(1, 40, model.image_channels, size, size)
    decoded_frames = {}  # latent count -> frames decoded: decode_video sees only the latents, one decode per count
    for t in range(1, 41):
        plan = model.plan(t)
        latents = model.encode_video(x[:, :t])
        if latents.shape[1] not in decoded_frames:
            decoded_frames[latents.shape[1]] = model.decode_video(latents).shape[1]
        decoded = decoded_frames[latents.shape[1]]
        assert (latents.shape[1], decoded) == (plan.latent_frames, plan.decoded_frames), (variant, t, plan)
        assert plan.aligned_frames == min(plan.decoded_frames, t) and plan.target(x[:, :t]).shape[1] == decoded
        assert model.plan(t) == get_variant(variant).plan(t)  # the one rule, for the model and for the config check


def test_frame_plans_of_the_new_variants():
    """What docs/evaluation.md's frame-rule tables say: LTX takes 8k+1 frames, H3 17-frame chunks."""
    ltx, h3 = get_variant("taeltx2_3"), get_variant("taeh3")
    assert [(ltx.plan(t).latent_frames, ltx.plan(t).decoded_frames) for t in (9, 16, 17, 121)] == [
        (2, 9),
        (2, 9),
        (3, 17),
        (16, 121),
    ]
    assert [(h3.plan(t).latent_frames, h3.plan(t).decoded_frames) for t in (5, 17, 20, 34, 51)] == [
        (2, 5),
        (2, 5),
        (7, 22),
        (7, 22),
        (12, 39),
    ]
    with pytest.raises(NotImplementedError, match="taeh3 cannot stream"):
        TAEHV(variant="taeh3").stream()


def test_unknown_variant_lists_known_ones():
    with pytest.raises(ValueError, match="taehv1_5_super"):
        get_variant("taevae")


def test_explicit_variant_beats_file_name(tmp_path):
    path = tmp_path / "weights_without_a_hint.pth"
    torch.save(TAEHV(variant="taehv1_5").state_dict(), path)
    with pytest.raises(CheckpointMismatchError) as err:
        TAEHV(path)  # nothing in the name: a default (taehv-shaped) model is built
    message = str(err.value)
    assert "missing keys" not in message and "shape mismatch encoder.0.weight" in message
    assert "variant='taehv1_5'" in message
    model = TAEHV(path, variant="taehv1_5")
    assert (model.patch_size, model.latent_channels) == (2, 32)


def test_mismatch_lists_missing_unexpected_and_shapes(tmp_path):
    sd = TAEHV(variant="taehv").state_dict()
    sd.pop("decoder.22.bias")
    sd["encoder.99.weight"] = torch.zeros(1)
    sd["encoder.17.weight"] = torch.zeros(8, 64, 3, 3)
    path = tmp_path / "taehv.pth"
    torch.save(sd, path)
    with pytest.raises(CheckpointMismatchError) as err:
        TAEHV(path)
    message = str(err.value)
    assert "missing keys (1): decoder.22.bias" in message
    assert "unexpected keys (1): encoder.99.weight" in message
    assert "shape mismatch encoder.17.weight: model [16, 64, 3, 3], file [8, 64, 3, 3]" in message
    assert "fits no known variant" in message


def test_missing_file_and_non_state_dict(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoints/README.md"):
        TAEHV(tmp_path / "taehv.pth")
    path = tmp_path / "taehv.pth"
    torch.save({"model": TAEHV(variant="taehv").state_dict(), "step": 3}, path)
    with pytest.raises(CheckpointMismatchError, match="not a plain state dict"):
        TAEHV(path)


def test_pth_with_pickled_objects_is_refused(tmp_path):
    path = tmp_path / "taehv.pth"
    torch.save({"encoder.0.weight": torch.zeros(1), "evil": object()}, path)
    with pytest.raises(WeightsError, match="holds objects other than tensors .* refused for safety") as err:
        read_state_dict(path)
    assert "weights_only=False" not in str(err.value)  # never the advice to unpickle it


def test_weights_holding_nan_or_inf_are_refused_and_large_finite_values_pass_the_check(tmp_path):
    sd = TAEHV(variant="taehv").state_dict()
    sd["encoder.0.weight"][0, 0, 0, 0] = float("nan")
    sd["decoder.22.bias"][0] = float("-inf")
    torch.save(sd, tmp_path / "taehv.pth")
    with pytest.raises(WeightsError, match=r"2 tensor\(s\) hold NaN or Inf \(e.g. encoder.0.weight\)"):
        TAEHV(tmp_path / "taehv.pth")
    assert all_finite(torch.full((4,), 3e38)) and not all_finite(torch.tensor([1.0, float("nan")]))


@pytest.mark.parametrize("variant", ["taehv", "taecvx", "taehv1_5_super"])
@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_save_load_round_trip(tmp_path, variant, suffix):
    torch.manual_seed(0)
    model = TAEHV(variant=variant).to(torch.bfloat16)  # exports must still be fp32
    path = save_weights(model, tmp_path / f"final_model{suffix}")
    sd = read_state_dict(path)
    assert all(v.dtype == torch.float32 for v in sd.values())
    assert sd.keys() == model.state_dict().keys()
    loaded = TAEHV(path, variant=variant if suffix == ".pth" else None)
    assert loaded.variant == variant
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v.float()), k
    if suffix == ".safetensors":
        meta = read_metadata(path)
        assert meta["variant"] == variant and meta["patch_size"] == str(model.patch_size)
        assert json.loads(meta["decoder_time_upscale"]) == [False, True, True]
        assert "frame i matches input frame i" in meta["frame_rule"]


def test_custom_architecture_round_trips_through_metadata(tmp_path):
    model = TAEHV(None, patch_size=2, latent_channels=8)
    path = save_weights(model, tmp_path / "tiny.safetensors")
    loaded = TAEHV(path)
    assert (loaded.variant, loaded.patch_size, loaded.latent_channels) == ("custom", 2, 8)


def test_preview_decoder_loads_full_weights(tmp_path):
    full = TAEHV(variant="taehv")
    path = save_weights(full, tmp_path / "taehv.pth")
    preview = TAEHV(path, decoder_time_upscale=(False, False))
    assert preview.t_upscale == 1 and preview.frames_to_trim == 0
    for i in (7, 13, 19):
        key = f"decoder.{i}.conv.weight"
        n = preview.state_dict()[key].shape[0]
        assert torch.equal(preview.state_dict()[key], full.state_dict()[key][-n:])
    with torch.no_grad():
        assert preview.decode_video(torch.zeros(1, 3, 16, 4, 4)).shape == (1, 3, 3, 32, 32)


def test_spatial_and_layout_errors():
    model = TAEHV(variant="taehv1_5")
    with pytest.raises(ValueError, match="multiples of 16"):
        model.encode_video(torch.rand(1, 4, 3, 40, 64))
    with pytest.raises(ValueError, match="NTCHW"):
        model.encode_video(torch.rand(1, 3, 4, 32, 32))
    with pytest.raises(ValueError, match="32 channels"):
        model.decode_video(torch.rand(1, 2, 16, 4, 4))


def test_forward_trains_through_decoder_without_inplace_clamp():
    torch.manual_seed(0)
    model = TAEHV(variant="taehv")
    x = torch.rand(2, 9, 3, 16, 16)
    z_ref = torch.randn(2, 3, 16, 2, 2)
    out = model(x, reference_latents=z_ref)
    assert out.latents.shape == (2, 3, 16, 2, 2)
    assert out.decoded.shape == out.decoded_from_reference.shape == (2, 9, 3, 16, 16)
    with torch.no_grad():
        model.decoder[-1].bias.fill_(5.0)  # push outputs far above 1: unclamped values must stay
    out = model(x, reference_latents=z_ref)
    assert out.decoded.max() > 1
    loss = (out.decoded - 1).square().mean() + (out.latents - 0).square().mean()
    loss.backward()
    assert model.decoder[-1].bias.grad.abs().sum() > 0  # a clamp would zero this gradient
    assert all(p.grad is not None for p in model.encoder.parameters())
    with torch.no_grad():
        assert model.decode_video(out.latents).max() <= 1


@torch.no_grad()
def test_streaming_accepts_chunks_and_matches_batch():
    torch.manual_seed(0)
    model = TAEHV(variant="taehv").eval()
    x = torch.rand(1, 11, 3, 16, 16)
    reference = model.decode_video(model.encode_video(x))
    stream = model.stream()
    frames = []
    for chunk in x.split(3, dim=1):  # several frames per call: latents come out one per call
        latent = stream.encode(chunk)
        while latent is not None:
            frame = stream.decode(latent)
            while frame is not None:
                frames.append(frame)
                frame = stream.decode()
            latent = stream.encode()
    frames += stream.flush()
    torch.testing.assert_close(torch.cat(frames, 1), reference, atol=1e-5, rtol=0)


MEMORY_PROBE = textwrap.dedent(
    """
    import json, sys, torch
    from taehv_train.models.taehv import TAEHV
    from taehv_train.training.loop.monitoring import peak_rss_bytes
    torch.set_num_threads(1)
    model = TAEHV(variant="taehv").eval()
    latents = torch.randn(1, int(sys.argv[1]), 16, 16, 16)
    with torch.inference_mode():
        model.decode_video(latents[:, :1], parallel=sys.argv[2] == "parallel")  # warm-up
        base = peak_rss_bytes()
        out = model.decode_video(latents, parallel=sys.argv[2] == "parallel")
    peak = peak_rss_bytes()
    print(json.dumps({"growth_mb": (peak - base) / 2**20, "output_mb": out.numel() * 4 / 2**20}))
    """
)


def _decode_memory(tmp_path, latents: int, mode: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(latents), mode],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
    )
    return json.loads(result.stdout)


@pytest.mark.slow
def test_sequential_decode_memory_is_flat_in_t(tmp_path):
    short = _decode_memory(tmp_path, 2, "sequential")
    long = _decode_memory(tmp_path, 12, "sequential")
    # activations are O(1) in T: beyond the output tensor itself, growth stays within noise
    assert long["growth_mb"] - long["output_mb"] < short["growth_mb"] - short["output_mb"] + 40, (short, long)
    parallel = _decode_memory(tmp_path, 12, "parallel")
    assert parallel["growth_mb"] - parallel["output_mb"] > long["growth_mb"] - long["output_mb"] + 150, (long, parallel)


def test_known_variants_all_build():
    with torch.device("meta"):
        for name in known_variants():
            assert TAEHV(variant=name).variant == name


@pytest.mark.parametrize("channels_last", [False, True])
def test_with_past_is_the_shifted_concatenation(channels_last):
    n, t, c, h, w = 2, 3, 4, 5, 6
    x = torch.randn(n * t, c, h, w)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    seq = x.view(n, t, c, h, w)
    past = torch.cat([torch.zeros(n, 1, c, h, w), seq[:, :-1]], 1).view(n * t, c, h, w)
    stacked = with_past(x, n)
    assert torch.equal(stacked, torch.cat([x, past], 1))
    assert stacked.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def test_parallel_memory_blocks_match_their_per_frame_form_with_gradients():
    """The fast paths' one-copy input and in-place residual give the same values and gradients."""
    torch.manual_seed(0)
    for block in (MemBlock(8, 8), MemBlock(8, 4), SuperMemBlock(8), WideMemBlock(64, 128)):
        c = block.conv[0].in_channels // 2
        x = torch.randn(2 * 3, c, 6, 6, requires_grad=True)
        past = torch.cat([torch.zeros(2, 1, c, 6, 6), x.view(2, 3, c, 6, 6)[:, :-1]], 1).view(6, c, 6, 6)
        expected = block(x, past)
        (grad_expected,) = torch.autograd.grad(expected.square().sum(), x)
        got = forward_stacked(block, x, with_past(x, 2))
        (grad_got,) = torch.autograd.grad(got.square().sum(), x)
        assert torch.equal(got, expected)
        assert torch.allclose(grad_got, grad_expected, atol=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("parallel", [True, False])
def test_channels_last_gives_the_same_video(parallel):
    torch.manual_seed(0)
    model = TAEHV(variant="taecvx").eval()
    x = torch.rand(1, 9, 3, 32, 48)
    expected = model.decode_video(model.encode_video(x, parallel=parallel), parallel=parallel)
    model = model.to(memory_format=torch.channels_last)
    got = model.decode_video(model.encode_video(x, parallel=parallel), parallel=parallel)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("variant", ["taeh3", "taeltx2_3", "taeltx2_3_wide"])
def test_preview_decoders_of_the_newer_variants_load_full_weights(variant, tmp_path):
    full = TAEHV(variant=variant)
    path = save_weights(full, tmp_path / f"{variant}.pth")
    preview = TAEHV(path, decoder_time_upscale=(False, False)).eval()  # one frame per latent
    size = 8 * full.patch_size
    latents = full.encode_video(torch.rand(1, 17, 3, size, size))
    decoded = preview.decode_video(latents)
    assert decoded.shape[1] == latents.shape[1] == preview.plan(17).decoded_frames
    assert decoded.shape[-2:] == (size, size)


@torch.no_grad()
@pytest.mark.parametrize("variant", ["taehv", "taeltx2_3"])
def test_encoder_stem_in_bands_of_one_row_gives_the_same_latents(variant, monkeypatch):
    """The encoder's first stage runs in bands of rows (halo rows recomputed, zero rows at
    the borders); one output row per band gives what the whole frame gives."""
    torch.manual_seed(0)
    model = TAEHV(variant=variant).eval()
    assert fused_schedule(model.encoder).steps[0].kind is Kind.STEM
    x = torch.rand(1, 9, 3, 16 * model.patch_size, 24 * model.patch_size)
    whole = model.encode_video(x)
    monkeypatch.setattr(fast_ops, "BAND_BYTES", 1)
    torch.testing.assert_close(model.encode_video(x), whole, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_derived_weights_follow_the_weights():
    """Merged and sub-pixel weights are cached for a run, and recomputed when a weight
    changes in place (an optimizer step, load_state_dict)."""
    torch.manual_seed(0)
    model = TAEHV(variant="taehv").eval()
    z = torch.randn(1, 2, 16, 4, 4)
    before = model.decode_video(z)
    other = TAEHV(variant="taehv").state_dict()
    model.load_state_dict(other)
    fresh = TAEHV(variant="taehv").eval()
    fresh.load_state_dict(other)
    torch.testing.assert_close(model.decode_video(z), fresh.decode_video(z))
    assert not torch.allclose(model.decode_video(z), before)


@torch.no_grad()
def test_bf16_weights_and_autocast_run_the_plain_blocks():
    """The fused path is fp32 only: bf16 weights (a bf16 run's model) and autocast run the
    published blocks, as before, and give the fp32 result to bf16 precision."""
    torch.manual_seed(0)
    model = TAEHV(variant="taehv").eval()
    z = torch.randn(1, 2, 16, 2, 2)
    reference = model.decode_video(z)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = model.decode_video(z)
        bf16_weights = model.to(torch.bfloat16).decode_video(z)  # fp32 input, bf16 weights
    for out in (autocast, bf16_weights):
        torch.testing.assert_close(out.float(), reference, atol=0.05, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("variant", ["taehv", "taehv1_5_super"])
def test_module_hooks_fire_on_the_published_path(variant):
    """Where no fast path is taken (here float64 on CPU; GPUs, compiled inference), every
    block and every convolution runs its ``forward``, so forward hooks see all of them."""
    model = TAEHV(variant=variant).double().eval()
    z = torch.zeros(1, 1, model.latent_channels, 2, 2, dtype=torch.double)
    assert fast_paths.choose(model.decoder, z, None, keep_weights=False) is None
    modules = [m for m in model.modules() if isinstance(m, (torch.nn.Conv2d, MemBlock, SuperMemBlock))]
    fired = set()
    for m in modules:
        m.register_forward_hook(lambda m, args, out: fired.add(m))
    frames = torch.rand(1, 5, 3, 8 * model.patch_size, 8 * model.patch_size, dtype=torch.double)
    for parallel in (True, False):
        fired.clear()
        model.decode_video(model.encode_video(frames, parallel=parallel), parallel=parallel)
        assert len(fired) == len(modules), parallel


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("grad", [False, True])
def test_trimmed_frames_are_never_decoded_in_full(parallel, grad, monkeypatch):
    """The decoder's first ``frames_to_trim`` frames only feed the memory of later ones:
    the blocks after the last temporal one (the last conv here) never see them, on the
    fused path and with autograd, and the frames kept are unchanged."""
    torch.manual_seed(0)
    model = TAEHV(variant="taehv").eval()
    z = torch.randn(1, 3, 16, 2, 2)
    last = model.decoder[-1]
    seen = []
    conv2d_act = fast_ops.conv2d_act
    monkeypatch.setattr(
        fast_ops,
        "conv2d_act",
        lambda x, w, b, conv, *a, **k: (
            seen.append(x.shape[0]) if conv is last else None,
            conv2d_act(x, w, b, conv, *a, **k),
        )[1],
    )  # fused
    last.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))  # plain blocks
    with torch.set_grad_enabled(grad):
        frames = model.decode_video(z, parallel=parallel)
    assert frames.shape[1] == 3 * 4 - model.frames_to_trim
    assert sum(seen) == frames.shape[1]
    with torch.no_grad():
        reference = model.decode_video(z, parallel=True)
    torch.testing.assert_close(frames.detach(), reference, atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("chunk_bytes, per_chunk", [(1, 1), (3 * 4096, 3), (1 << 30, (1 << 30) // 4096)])
def test_sequential_decoding_in_chunks_of_latents_gives_the_same_frames(chunk_bytes, per_chunk, monkeypatch):
    """Sequential decoding takes as many latents at once as fit ``SEQUENTIAL_CHUNK_BYTES``
    of first-stage activations (one, uneven chunks, all): the frames do not change."""
    torch.manual_seed(0)
    model = TAEHV(variant="taehv").eval()
    z = torch.randn(1, 5, 16, 2, 2)  # first stage: 256 channels of 2x2, 4096 bytes a latent
    reference = model.decode_video(z, parallel=True)
    monkeypatch.setattr(taehv_module, "SEQUENTIAL_CHUNK_BYTES", chunk_bytes)
    assert model.latents_per_chunk(z) == per_chunk
    torch.testing.assert_close(model.decode_video(z, parallel=False), reference, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_sequential_run_derives_each_weight_once(monkeypatch):
    """Sequential decoding runs the blocks after each TGrow once per frame, even when all
    latents fit one chunk: the sub-pixel weights are derived once for the run, not per frame."""
    torch.manual_seed(0)
    model = TAEHV(variant="taehv").eval()
    made = []
    weight = fast_ops.OneDNN.weight
    monkeypatch.setattr(
        fast_ops.OneDNN,
        "weight",
        lambda self, owner, name, make: weight(self, owner, name, lambda: (made.append((id(owner), name)), make())[1]),
    )
    z = torch.randn(1, 2, 16, 2, 2)
    assert model.latents_per_chunk(z) >= 2  # one chunk
    model.decode_video(z, parallel=False)
    assert made and len(made) == len(set(made)), made


# -- TAEs built for reference VAEs with no published one --------------------------------------


def test_built_variants_have_their_reference_vaes_frame_rules():
    """Mochi's 6x time (a 3x stage beside a 2x one), Allegro's non-causal 4L <-> L (no
    trim), image-only SVD and Qwen-Image 2.1 (RGBA), Cosmos's 8x."""

    def counts(name, frames):
        return [(get_variant(name).plan(t).latent_frames, get_variant(name).plan(t).decoded_frames) for t in frames]

    assert counts("tae_mochi", (7, 13, 25)) == [(2, 7), (3, 13), (5, 25)] and get_variant(
        "tae_mochi"
    ).exact_frame_counts(20) == [1, 7, 13, 19]
    assert counts("tae_allegro", (4, 8, 9)) == [(1, 4), (2, 8), (3, 12)] and get_variant(
        "tae_allegro"
    ).exact_frame_counts(12) == [4, 8, 12]
    assert counts("tae_svd", (1, 5)) == [(1, 1), (5, 5)] and counts("tae_cosmos", (9, 17)) == [(2, 9), (3, 17)]
    qwen = get_variant("tae_qwenimage2_1")
    assert (qwen.image_channels, qwen.patch_size, qwen.latent_channels, counts("tae_qwenimage2_1", (1,))) == (
        4,
        2,
        64,
        [(1, 1)],
    )
    assert [split_time(f) for f in (1, 4, 6, 8)] == [(1, 1, 1), (2, 2, 1), (2, 3, 1), (2, 2, 2)]
    with pytest.raises(ValueError, match="5x time axis is not a product of at most three 2x or 3x stages"):
        split_time(5)
    with pytest.raises(ValueError, match="64x spatial compression is not one the TAE expresses"):
        get_variant("tae_vidtok_c4_s64_t4")


@torch.no_grad()
@pytest.mark.parametrize("variant, frames", [("tae_mochi", 13), ("tae_allegro", 8), ("tae_qwenimage2_1", 2)])
def test_built_variants_run_in_every_mode_alike(variant, frames):
    """Parallel, sequential and streaming give the same latents and frames, also with a 3x
    stage (Mochi), no trim (Allegro) and four image channels (RGBA)."""
    torch.manual_seed(0)
    model = TAEHV(variant=variant).eval()
    size = 8 * model.patch_size
    x = torch.rand(1, frames, model.image_channels, size, size)
    latents = model.encode_video(x)
    decoded = model.decode_video(latents)
    assert decoded.shape == x.shape
    torch.testing.assert_close(model.encode_video(x, parallel=False), latents, atol=1e-5, rtol=0)
    torch.testing.assert_close(model.decode_video(latents, parallel=False), decoded, atol=1e-5, rtol=0)
    stream = model.stream()
    streamed = [
        frame
        for latent in [stream.encode(f) for f in x.split(1, 1)]
        if latent is not None
        for frame in [stream.decode(latent), *iter(stream.decode, None)]
        if frame is not None
    ]
    torch.testing.assert_close(torch.cat(streamed + stream.flush(), 1), decoded, atol=1e-5, rtol=0)


def test_a_built_architecture_loads_from_its_file_alone(tmp_path):
    """A TAE built for another configuration of a reference VAE (VidTok with 16 channels) is
    named by what differs; its file records the whole architecture, so it loads by itself,
    also under a name this version does not know."""
    name = built_name("tae_vidtok", 16, 8, 4)
    assert name == "tae_vidtok_c16_s8_t4" and built_name("tae_mochi", 12, 8, 6) == "tae_mochi"
    model = TAEHV(variant="tae_mochi")
    path = save_weights(model, tmp_path / "model.safetensors")
    meta = read_metadata(path)
    assert (json.loads(meta["encoder_time_downscale"]), meta["causal"], meta["image_channels"]) == (
        [2, 3, 1],
        "true",
        "3",
    )
    assert TAEHV(path).decoder_time_upscale == (1, 3, 2)
    from safetensors.torch import save_file

    renamed = tmp_path / "future.safetensors"
    save_file(read_state_dict(path), renamed, metadata={**meta, "variant": "tae_from_the_future"})
    loaded = TAEHV(renamed)
    assert (loaded.variant, loaded.t_downscale, loaded.t_upscale) == ("tae_from_the_future", 6, 6)
    allegro = save_weights(TAEHV(variant="tae_allegro_c8_s16_t4"), tmp_path / "allegro.safetensors")
    assert (TAEHV(allegro).patch_size, TAEHV(allegro).latent_channels, TAEHV(allegro).frames_to_trim) == (2, 8, 0)


def test_a_3x_stage_trains():
    """Gradients reach every weight through the 3x temporal stages (the autograd path)."""
    torch.manual_seed(0)
    model = TAEHV(variant="tae_mochi")
    out = model(torch.rand(1, 7, 3, 8, 8))
    (out.latents.square().mean() + out.decoded.square().mean()).backward()
    assert out.decoded.shape[1] == 7 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
