"""Code written against the published ``taehv.py`` keeps working with
``from taehv_train.models.taehv import TAEHV, StreamingTAEHV``.

The published implementation (``../shared/reference/taehv_published.py``, and
``taehv_published_wide.py`` for ``taeltx2_3_wide``) is imported by path, never copied,
and its own calling patterns are run against ours on the same weights: a freshly built
published model of each variant is saved with ``torch.save`` under the published file
name (``taehv.pth``, ``taecvx.pth``, ...), and both implementations load that file.
Outputs must agree within 1e-4 (fp32, CPU, the smallest valid sizes).

The fresh weights are PyTorch's default initialisation scaled by sqrt(6) (He scale):
with the default scale the activations fade through the ~20 layers and every decoded
frame is nearly the same whatever the input (a time-reversed clip decodes within 1e-7),
so a 1e-4 comparison would not notice frames in the wrong order.

Known, deliberate difference: a taecvx stream drops its first ``frames_to_trim`` frames
as ``decode_video`` does for an odd latent count; the published stream keeps them
(``test_stream_taecvx_drops_the_startup_frames``).
"""

from __future__ import annotations

import copy
import shutil
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.lib.harness import load_published, published_file
from conftest import _require, shared_dir
from taehv_train.models.taehv import TAEHV, StreamingTAEHV

ATOL = 1e-4
# Published file name (stem) -> (frames, height = width) of the smallest clip used with it:
# H and W multiples of 8 * patch_size; enough frames for two or three latents.
VARIANTS = {
    "taehv": (9, 8),
    "taecvx": (9, 8),
    "taehv1_5": (5, 16),
    "taew2_2": (5, 16),
    "taehv1_5_super": (5, 16),
    "taeh3": (5, 16),
    "taeltx2_3": (9, 32),
    "taeltx2_3_wide": (9, 32),
}
STREAMING = ("taehv", "taehv1_5", "taew2_2", "taehv1_5_super", "taeltx2_3")
ATTRIBUTES = (
    "patch_size",
    "latent_channels",
    "image_channels",
    "t_downscale",
    "t_upscale",
    "frames_to_trim",
    "is_cogvideox",
)


# ---------------------------------------------------------------------------------------
# The published implementation, its weights, and helpers


@pytest.fixture(scope="module")
def pub():
    """The published modules: ``pub["base"]`` (taehv.py) and ``pub["wide"]`` (the
    ``2026_03_11_taeltx23_wide`` branch's taehv.py, for taeltx2_3_wide)."""
    _require(shared_dir() / "reference", "published taehv.py")
    return {"base": load_published(published_file()), "wide": load_published(published_file("taeltx2_3_wide"))}


def _module_for(pub, name):
    return pub["wide"] if "wide" in name else pub["base"]


def save_fresh_published(module, path, seed=0, **kwargs):
    """Build the published ``TAEHV(str(path), **kwargs)`` freshly initialised (its own
    file-name rules pick the architecture), weights scaled to He scale, and save its
    state dict to ``path`` with ``torch.save``."""

    class Fresh(module.TAEHV):
        def patch_tgrow_layers(self, sd):  # keep the fresh weights instead of the placeholder file's
            return self.state_dict()

    torch.save({}, path)  # the constructor loads the file it is named after
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Fresh(str(path), **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(6**0.5)
    torch.save(model.state_dict(), path)
    return str(path)


@pytest.fixture(scope="module")
def published(pub, tmp_path_factory):
    """name -> (path, published TAEHV loaded from it) for every VARIANTS name."""
    root = tmp_path_factory.mktemp("published_weights")
    out = {}
    for seed, name in enumerate(VARIANTS):
        module = _module_for(pub, name)
        path = save_fresh_published(module, root / f"{name}.pth", seed=seed)
        out[name] = (path, module.TAEHV(checkpoint_path=path).eval())
    return out


@pytest.fixture(scope="module")
def ours(published):
    """name -> our TAEHV loaded from the same file."""
    return {name: TAEHV(checkpoint_path=path).eval() for name, (path, _) in published.items()}


def video(name, frames=None, seed=0):
    t, hw = VARIANTS[name]
    return torch.rand(1, frames or t, 3, hw, hw, generator=torch.Generator().manual_seed(seed))


def latents(model, count, hw, seed=1):
    side = hw // (8 * model.patch_size)
    return torch.randn(1, count, model.latent_channels, side, side, generator=torch.Generator().manual_seed(seed))


def assert_same(actual, expected, what=""):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, published {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, what
    torch.testing.assert_close(actual, expected, rtol=0, atol=ATOL, msg=lambda m: f"{what}: {m}")


def shapes(model):
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def assert_same_state_dict(model, reference):
    assert shapes(model) == shapes(reference)
    ours_sd = model.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(ours_sd[key], value), key


def assert_same_attributes(model, reference):
    for attr in ATTRIBUTES:
        assert getattr(model, attr) == getattr(reference, attr), attr
    if hasattr(reference, "is_h3"):  # the wide branch predates taeh3
        assert model.is_h3 == reference.is_h3


def assert_not_saturated(frames):
    """A comparison of clamped frames means something only if they are not all 0 or 1."""
    assert ((frames > 0) & (frames < 1)).float().mean() > 0.05


def quiet(model, method, x):
    return getattr(model, method)(x, show_progress_bar=False)


def published_training_forward(module, model, x):
    """The published training forward: ``encode_video``, then the decoder through
    ``apply_model_with_memblocks``, trimmed and pixel-shuffled as ``decode_video`` does, without its in-place clamp."""
    z = model.encode_video(x, show_progress_bar=False)
    decoded = module.apply_model_with_memblocks(model.decoder, z, True, False)[:, model.frames_to_trim :]
    return z, F.pixel_shuffle(decoded, model.patch_size)


@pytest.mark.parametrize("name", ["taehv", "taeltx2_3_wide"])  # 2x and 8x time, patch 1 and 4, base and wide decoders
def test_training_gradients_are_the_published_models(name, published, pub, ours):
    """Our training path (TPools folded into the next conv, TGrows before the upsampling,
    upsampling convs as four 2x2 sub-pixel convs derived inside autograd) computes the
    published function: in float64 the losses and every parameter's gradient agree to
    1e-10, and in float32 our gradients are within 2e-3 of each float64 gradient's norm
    (ReLU nets amplify rounding in a few tensors: ~1e-4 in most, 1.2e-3 in taeltx2_3_wide's
    first decoder conv with 2 threads on an AMD EPYC, where the published path's own float32
    error is 1e-6)."""
    module, (_, reference) = _module_for(pub, name), published[name]
    x = video(name, seed=3).expand(2, -1, -1, -1, -1).contiguous()
    x[1] = x[1].flip(-1)

    def gradients(model, forward, dtype):
        model = copy.deepcopy(model).to(dtype).train()
        z, decoded = forward(model, x.to(dtype))
        loss = F.mse_loss(decoded, x[:, : decoded.shape[1]].to(dtype)) + z.square().mean()
        loss.backward()
        return loss.detach(), {key: p.grad for key, p in model.named_parameters()}

    def ours_forward(model, x):
        z = model.encode_video(x)
        return z, model.decode_video(z, clamp=False)

    def published_forward(model, x):
        return published_training_forward(module, model, x)

    loss64, expected = gradients(reference, published_forward, torch.float64)
    for dtype, tolerance in ((torch.float64, 1e-10), (torch.float32, 2e-3)):
        loss, got = gradients(ours[name], ours_forward, dtype)
        torch.testing.assert_close(loss.double(), loss64, rtol=tolerance, atol=0)
        for key, grad in expected.items():
            error = ((got[key].double() - grad).norm() / grad.norm()).item()
            assert error < tolerance, f"{dtype} gradient of {key}: relative error {error:.2e}"


def conv_depths(model, call, *entries):
    """Qualified name -> the Python frames from the innermost of ``entries`` (functions) down
    to ``nn.Conv2d.forward``, inclusive, at each call ``call()`` makes of a conv of ``model``."""
    codes, names = {f.__code__ for f in entries}, {m: k for k, m in model.named_modules()}
    depths = {}

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is nn.Conv2d.forward.__code__:
            depth, caller = 1, frame
            while caller.f_code not in codes:
                caller, depth = caller.f_back, depth + 1
            depths.setdefault(names[frame.f_locals["self"]], set()).add(depth)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return depths


@pytest.mark.parametrize("name", ["taehv", "taehv1_5_super", "taeltx2_3_wide"])  # base, super and wide decoders
@torch.no_grad()
def test_the_plain_path_calls_each_conv_no_deeper_than_the_published_runner(name, published, pub, ours):
    """Where no fast path is taken (float64), a conv is as few Python frames below
    ``TAEHV.forward`` as the published model's below ``encode_video`` / ``decode_video``
    (the runner calls the blocks itself, as ``apply_model_with_memblocks`` does), and in
    sequential mode no deeper below ``encode_video`` / ``decode_video`` than the published
    sequential runner's. A structural check, not a timing one."""
    published_class = _module_for(pub, name).TAEHV
    reference, model = copy.deepcopy(published[name][1]).double(), copy.deepcopy(ours[name]).double()
    x = video(name).double()

    def published_depths(parallel):
        def call():
            reference.decode_video(reference.encode_video(x, parallel, False), parallel, False)

        return conv_depths(reference, call, published_class.encode_video, published_class.decode_video)

    def sequential():
        model.decode_video(model.encode_video(x, parallel=False), parallel=False)

    for parallel, got in (
        (True, conv_depths(model, lambda: model(x), TAEHV.forward)),
        (False, conv_depths(model, sequential, TAEHV.encode_video, TAEHV.decode_video)),
    ):
        expected = published_depths(parallel)
        assert got.keys() == expected.keys()
        deeper = {k: (max(got[k]), min(expected[k])) for k in got if max(got[k]) > min(expected[k])}
        assert not deeper, f"parallel={parallel}: conv -> (our depth, published depth): {deeper}"


# ---------------------------------------------------------------------------------------
# Constructor


@torch.no_grad()
def test_default_checkpoint_is_taehv_pth_in_the_current_directory(published, pub, tmp_path, monkeypatch):
    """Published ``TAEHV()``: ``checkpoint_path="taehv.pth"`` by default, read from the
    current directory (a FileNotFoundError when it is not there)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError):
        pub["base"].TAEHV()
    with pytest.raises(FileNotFoundError):
        TAEHV()
    shutil.copy(published["taehv"][0], tmp_path / "taehv.pth")
    reference, model = pub["base"].TAEHV(), TAEHV()
    assert_same_attributes(model, reference)
    assert_same_state_dict(model, reference)
    z = latents(model, 2, 8)
    assert_same(model.decode_video(z), quiet(reference, "decode_video", z), "TAEHV() decode")


@pytest.mark.parametrize("name", VARIANTS)
@torch.no_grad()
def test_published_file_names_pick_the_published_architecture(name, published, ours):
    """Published ``TAEHV(checkpoint_path=path)``: the file name picks patch size, latent
    channels, time scaling, taecvx's frame rule, taeh3's chunking and the decoder (super,
    wide); the weights load into the same keys and shapes; ``preprocess_input_frames`` and
    ``postprocess_output_frames`` (pixel (un)shuffle, clamp) give the same tensors."""
    _, reference = published[name]
    model = ours[name]
    assert_same_attributes(model, reference)
    assert_same_state_dict(model, reference)
    x = video(name)
    assert_same(model.preprocess_input_frames(x), reference.preprocess_input_frames(x), "preprocess_input_frames")
    raw = 2 * torch.randn(1, 2, 3 * model.patch_size**2, 4, 4, generator=torch.Generator().manual_seed(2))
    # the published postprocess clamps in place: give it its own copy
    assert_same(
        model.postprocess_output_frames(raw.clone()),
        reference.postprocess_output_frames(raw.clone()),
        "postprocess_output_frames",
    )


PUBLISHED_ARGS = (
    "checkpoint_path",
    "encoder_time_downscale",
    "decoder_time_upscale",
    "decoder_space_upscale",
    "patch_size",
    "latent_channels",
    "arch_variant",
)


@pytest.mark.parametrize(
    "values",
    [
        pytest.param(((True, True, False), (False, True, True), (True, True, True), 1, 16, None), id="defaults"),
        pytest.param(((True, True, False), (False, False), (True, True, False), 1, 16, None), id="preview"),
    ],
)
@torch.no_grad()
def test_every_published_argument_positional_and_keyword(values, published, pub):
    """Published signature ``TAEHV(checkpoint_path, encoder_time_downscale,
    decoder_time_upscale, decoder_space_upscale, patch_size, latent_channels,
    arch_variant)``: the same model whether the arguments come by position or by name,
    including the preview decoder (a 2-tuple time upscale with False prepended, full
    weights loaded by ``patch_tgrow_layers``) and ``arch_variant=None``."""
    path, _ = published["taehv"]
    args = (path, *values)
    reference = pub["base"].TAEHV(*args)
    z = latents(reference, 2, 8)
    expected = quiet(reference, "decode_video", z)
    assert_not_saturated(expected)
    for model in (TAEHV(*args), TAEHV(**dict(zip(PUBLISHED_ARGS, args)))):
        assert_same_attributes(model, reference)
        assert_same_state_dict(model, reference)
        assert_same(model.decode_video(z), expected, "decode_video")


@torch.no_grad()
def test_fresh_model_from_positional_time_arguments(pub):
    """Published ``TAEHV(None, (True, False, False), (False, False, True))``: no weights,
    time scaling 2x both ways, the same keys and shapes; with the same weights the same
    latents and frames."""
    args = (None, (True, False, False), (False, False, True), (True, True, True), 1, 16, None)
    reference = pub["base"].TAEHV(*args).eval()
    model = TAEHV(*args).eval()
    assert (model.t_downscale, model.t_upscale, model.frames_to_trim) == (2, 2, 1)
    assert_same_attributes(model, reference)
    assert shapes(model) == shapes(reference)
    model.load_state_dict(reference.state_dict())
    x = video("taehv", frames=5)
    z = quiet(reference, "encode_video", x)
    assert_same(model.encode_video(x), z, "encode_video")
    assert_same(model.decode_video(z), quiet(reference, "decode_video", z), "decode_video")


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("taehv", {"decoder_time_upscale": (False, False)}),
        ("taehv", {"decoder_space_upscale": (True, True, False)}),
        ("taehv1_5", {"decoder_time_upscale": (False, False), "decoder_space_upscale": (True, True, False)}),
        ("taehv1_5_super", {"decoder_time_upscale": (False, False)}),
    ],
)
@torch.no_grad()
def test_preview_decoders_load_full_weights(name, kwargs, published, pub):
    """Published preview decoders: ``decoder_time_upscale=(False, False)`` keeps the last
    output channels of each TGrow weight (``patch_tgrow_layers``), no frames trimmed;
    ``decoder_space_upscale=(True, True, False)`` decodes at half size; same frames."""
    path, _ = published[name]
    reference = _module_for(pub, name).TAEHV(checkpoint_path=path, **kwargs)
    model = TAEHV(checkpoint_path=path, **kwargs)
    assert_same_attributes(model, reference)
    assert_same_state_dict(model, reference)
    z = latents(model, 2, VARIANTS[name][1])
    expected = quiet(reference, "decode_video", z)
    assert_not_saturated(expected)
    assert_same(model.decode_video(z), expected, "preview decode_video")


@pytest.mark.parametrize("file_name, patch_size, latent_channels", [("mytae.pth", 2, 8), ("taehv.pth", 1, 16)])
@torch.no_grad()
def test_arch_variant_super_with_custom_patch_and_latents(file_name, patch_size, latent_channels, pub, tmp_path):
    """Published ``arch_variant="super"``: the super decoder for the given patch size and
    latent channels, whatever the file is called (a name without a variant, or taehv.pth
    holding super weights), by keyword or position."""
    kwargs = {"patch_size": patch_size, "latent_channels": latent_channels, "arch_variant": "super"}
    path = save_fresh_published(pub["base"], tmp_path / file_name, seed=7, **kwargs)
    reference = pub["base"].TAEHV(checkpoint_path=path, **kwargs)
    hw = 8 * patch_size
    x = torch.rand(1, 5, 3, hw, hw, generator=torch.Generator().manual_seed(3))
    z = quiet(reference, "encode_video", x)
    expected = quiet(reference, "decode_video", z)
    assert_not_saturated(expected)
    for model in (
        TAEHV(checkpoint_path=path, **kwargs),
        TAEHV(path, (True, True, False), (False, True, True), (True, True, True), patch_size, latent_channels, "super"),
    ):
        assert_same_attributes(model, reference)
        assert_same_state_dict(model, reference)
        assert_same(model.encode_video(x), z, "encode_video")
        assert_same(model.decode_video(z), expected, "decode_video")


@torch.no_grad()
def test_arch_name_taeh3_builds_without_weights(published, tmp_path, monkeypatch):
    """Upstream's newer ``TAEHV(arch_name="taeh3")``: the keyword names the architecture
    (patch 2, 24 latent channels, H3 chunking) and, with no checkpoint path, builds it
    without reading any file (the current directory is empty, so a default taehv.pth
    would raise); given the taeh3.pth weights it encodes and decodes as the published."""
    monkeypatch.chdir(tmp_path)
    model = TAEHV(arch_name="taeh3").eval()
    _, reference = published["taeh3"]
    assert (model.patch_size, model.latent_channels) == (2, 24)
    assert_same_attributes(model, reference)
    assert shapes(model) == shapes(reference)
    model.load_state_dict(reference.state_dict())
    x = video("taeh3")
    z = quiet(reference, "encode_video", x)
    assert_same(model.encode_video(x), z, "taeh3 encode_video")
    assert_same(model.decode_video(z), quiet(reference, "decode_video", z), "taeh3 decode_video")


@torch.no_grad()
def test_arch_name_taeltx2_3_with_explicit_none_checkpoint(published, tmp_path, monkeypatch):
    """``TAEHV(checkpoint_path=None, arch_name="taeltx2_3")``: the LTX architecture (patch
    4, 128 latent channels, 8x time both ways, 7 frames trimmed), no weights read."""
    monkeypatch.chdir(tmp_path)
    model = TAEHV(checkpoint_path=None, arch_name="taeltx2_3").eval()
    _, reference = published["taeltx2_3"]
    assert (model.patch_size, model.latent_channels) == (4, 128)
    assert (model.t_downscale, model.t_upscale, model.frames_to_trim) == (8, 8, 7)
    assert_same_attributes(model, reference)
    assert shapes(model) == shapes(reference)
    model.load_state_dict(reference.state_dict())
    z = latents(model, 2, 32)
    assert_same(model.decode_video(z), quiet(reference, "decode_video", z), "taeltx2_3 decode_video")


@torch.no_grad()
def test_super_decoder_without_spatial_upscale(pub):
    """Published ``TAEHV(None, decoder_space_upscale=(True, True, False),
    arch_variant="super")`` builds (PixelShuffle(1) and a conv to 64 channels in the last
    stage) and decodes at half size."""
    kwargs = {"checkpoint_path": None, "decoder_space_upscale": (True, True, False), "arch_variant": "super"}
    reference = pub["base"].TAEHV(**kwargs).eval()
    model = TAEHV(**kwargs).eval()
    assert shapes(model) == shapes(reference)
    model.load_state_dict(reference.state_dict())
    z = latents(model, 2, 8)
    assert_same(model.decode_video(z), quiet(reference, "decode_video", z), "decode_video")


# ---------------------------------------------------------------------------------------
# encode_video / decode_video

# (positional args, keyword args) for parallel / show_progress_bar, True and False
CALLS = [
    ((True, True), {}),
    ((), {"parallel": False, "show_progress_bar": False}),
    ((False,), {"show_progress_bar": True}),
    ((), {"parallel": True, "show_progress_bar": False}),
]


@pytest.mark.parametrize(
    "name, frames", [(name, None) for name in VARIANTS] + [("taecvx", 5)], ids=[*VARIANTS, "taecvx-even-latents"]
)
@torch.no_grad()
def test_encode_decode_video_calls(name, frames, published, ours):
    """Published ``encode_video(x, parallel=True, show_progress_bar=True)`` and
    ``decode_video(z, parallel=True, show_progress_bar=True)``: by position and keyword,
    parallel and sequential, same latents and frames (frame counts included: taecvx keeps
    all frames for an even latent count, taeh3 chunks, taeltx trims 7)."""
    _, reference = published[name]
    model = ours[name]
    x = video(name, frames)
    z = quiet(reference, "encode_video", x)
    expected = quiet(reference, "decode_video", z)
    assert_not_saturated(expected)
    for args, kwargs in CALLS:
        what = f"args={args} kwargs={kwargs}"
        assert_same(model.encode_video(x, *args, **kwargs), z, f"encode_video {what}")
        assert_same(model.decode_video(z, *args, **kwargs), expected, f"decode_video {what}")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1), (torch.float16, 2)])
@torch.no_grad()
def test_main_roundtrip_pattern(dtype, tolerance, published, pub):
    """The published ``main()``: ``TAEHV(checkpoint_path=...).to(device, dtype)``,
    ``encode_video(vid)`` / ``decode_video(enc)`` (and ``parallel=False`` for long videos),
    then ``vid_dec.clamp_(0, 1).mul_(255).round_().byte().cpu()[0]`` gives the published
    uint8 frames (within one rounding step; main's own dtype, fp16, is used on the CPU
    too when there is no GPU)."""
    path, _ = published["taehv"]
    dev = torch.device("cpu")
    frames = (torch.rand(1, 9, 3, 8, 8, generator=torch.Generator().manual_seed(4)) * 255).round().byte()
    taehv = TAEHV(checkpoint_path=path).to(dev, dtype)
    reference = pub["base"].TAEHV(checkpoint_path=path).to(dev, dtype)
    for kwargs in ({}, {"parallel": False}):
        vid_dev = frames.to(dev, dtype).div_(255.0)
        vid_enc = taehv.encode_video(vid_dev, **kwargs)
        vid_dec = taehv.decode_video(vid_enc, **kwargs)
        assert vid_dec.is_contiguous() and vid_dec.dtype == dtype
        out = vid_dec.clamp_(0, 1).mul_(255).round_().byte().cpu()[0]
        assert out.dtype == torch.uint8 and out.shape == (9, 3, 8, 8)
        assert torch.equal(vid_dec[0].byte(), out)  # the in-place chain changed vid_dec itself
        ref_enc = reference.encode_video(frames.to(dev, dtype).div_(255.0), show_progress_bar=False, **kwargs)
        ref_dec = reference.decode_video(ref_enc, show_progress_bar=False, **kwargs)
        expected = ref_dec.clamp_(0, 1).mul_(255).round_().byte().cpu()[0]
        assert expected.float().std() > 10  # not a flat video
        assert (out.int() - expected.int()).abs().max() <= tolerance, kwargs


# ---------------------------------------------------------------------------------------
# StreamingTAEHV


def encode_decode_loop(stream_cls, taehv, clip):
    """The published docstring's video-to-video loop, recording every call."""
    streaming = stream_cls(taehv)
    calls, shown = [], []
    for t in range(clip.shape[1]):
        latent = streaming.encode(clip[:, t : t + 1])
        decoded = streaming.decode(latent)  # feeds latent if not None, then returns next frame
        calls.append((latent, decoded is not None, streaming.n_frames_encoded))
        if decoded is not None:
            shown.append(decoded)
    flushed = streaming.flush()
    return calls, shown + flushed, len(flushed), streaming.n_frames_encoded, streaming.n_frames_decoded


def world_model_loop(stream_cls, taehv, z):
    """The published docstring's decode-only loop: ``decode(latent)`` returns the first
    frame, ``decode()`` the rest; frames grouped by latent."""
    streaming = stream_cls(taehv)
    per_latent, counters = [], []
    for t in range(z.shape[1]):
        frames = []
        frame = streaming.decode(z[:, t : t + 1])
        while frame is not None:
            frames.append(frame)
            counters.append(streaming.n_frames_decoded)
            frame = streaming.decode()
        per_latent.append(frames)
    return per_latent, counters, streaming.n_frames_decoded


@pytest.mark.parametrize("name", STREAMING)
@torch.no_grad()
def test_stream_encode_decode_loop(name, published, ours, pub):
    """Published ``StreamingTAEHV`` video-to-video usage: one frame at a time through
    ``encode`` then ``decode(latent)``, then ``flush()``: the same calls return latents and
    frames, with the same values, the same frame count, and ``n_frames_encoded`` /
    ``n_frames_decoded`` at the end."""
    _, reference = published[name]
    clip = video(name)
    ref_calls, ref_frames, ref_flushed, ref_enc, ref_dec = encode_decode_loop(
        pub["base"].StreamingTAEHV, reference, clip
    )
    calls, frames, flushed, n_enc, n_dec = encode_decode_loop(StreamingTAEHV, ours[name], clip)
    assert [(lat is not None, dec, n) for lat, dec, n in calls] == [
        (lat is not None, dec, n) for lat, dec, n in ref_calls
    ]
    for (latent, *_), (ref_latent, *_) in zip(calls, ref_calls):
        if ref_latent is not None:
            assert_same(latent, ref_latent, "streamed latent")
    assert (len(frames), flushed, n_enc, n_dec) == (len(ref_frames), ref_flushed, ref_enc, ref_dec)
    assert_not_saturated(torch.cat(ref_frames, 1))
    for i, (frame, ref_frame) in enumerate(zip(frames, ref_frames)):
        assert_same(frame, ref_frame, f"streamed frame {i}")


@pytest.mark.parametrize("name", STREAMING)
@torch.no_grad()
def test_stream_world_model_decode(name, published, ours, pub):
    """Published decode-only ("world model") usage: ``decode(latent)`` returns the first
    of the latent's frames at once (after the startup trim), ``decode()`` the rest, then
    None; the same frames per latent and the same ``n_frames_decoded`` at the end."""
    _, reference = published[name]
    z = latents(ours[name], 3, VARIANTS[name][1])
    ref_frames, _, ref_n = world_model_loop(pub["base"].StreamingTAEHV, reference, z)
    frames, _, n = world_model_loop(StreamingTAEHV, ours[name], z)
    assert [len(f) for f in frames] == [len(f) for f in ref_frames]
    assert n == ref_n
    for t, (group, ref_group) in enumerate(zip(frames, ref_frames)):
        for i, (frame, ref_frame) in enumerate(zip(group, ref_group)):
            assert_same(frame, ref_frame, f"latent {t} frame {i}")


@torch.no_grad()
def test_stream_n_frames_decoded_counts_returned_frames(published, ours, pub):
    """Published ``n_frames_decoded``: raw decoder frames produced so far, one more per
    frame returned (4, 5, 6, 7, 8, 9, ... for taehv in the world-model loop)."""
    _, reference = published["taehv"]
    z = latents(ours["taehv"], 3, 8)
    _, ref_counters, _ = world_model_loop(pub["base"].StreamingTAEHV, reference, z)
    _, counters, _ = world_model_loop(StreamingTAEHV, ours["taehv"], z)
    assert counters == ref_counters


@pytest.mark.parametrize("name", ["taehv", "taeltx2_3"])
@torch.no_grad()
def test_stream_flush_and_reset(name, published, ours, pub):
    """Published ``encode(frames)`` with several frames at once, ``encode()`` to drain,
    ``flush_encoder()`` (pads with the last frame), ``decode(latents)`` plus
    ``flush_decoder()``, and ``reset()`` (counters to zero, a new stream gives the same
    output again)."""
    clip = video(name)

    def run(streaming):
        got = [streaming.encode(clip[:, :2]), streaming.encode(clip[:, 2:])]  # the last frame ends a multi-frame call
        while (latent := streaming.encode()) is not None:
            got.append(latent)
        got = [latent for latent in got if latent is not None]
        flushed = streaming.flush_encoder()
        n_enc = streaming.n_frames_encoded
        frames = [streaming.decode(torch.cat(got + flushed, 1))] + streaming.flush_decoder()
        return got, flushed, n_enc, frames, streaming.n_frames_decoded

    ref_streaming = pub["base"].StreamingTAEHV(published[name][1])
    streaming = StreamingTAEHV(ours[name])
    expected = run(ref_streaming)
    for attempt in range(2):
        got, flushed, n_enc, frames, n_dec = run(streaming)
        assert (len(got), len(flushed), n_enc, len(frames), n_dec) == (
            len(expected[0]),
            len(expected[1]),
            expected[2],
            len(expected[3]),
            expected[4],
        ), attempt
        for actual, ref in zip(got + flushed + frames, expected[0] + expected[1] + expected[3]):
            assert_same(actual, ref, f"attempt {attempt}")
        streaming.reset()
        assert (streaming.n_frames_encoded, streaming.n_frames_decoded) == (0, 0)
    assert len(expected[1]) == 1  # the clip's last group was padded


@torch.no_grad()
def test_stream_taecvx_drops_the_startup_frames(published, ours, pub):
    """taecvx streaming, a deliberate difference: the published stream never trims taecvx
    (it keeps the first ``frames_to_trim`` frames); ours drops them, as ``decode_video``
    does for an odd latent count, because a stream cannot know the final latent count.
    Our frames equal the published stream's after its first ``frames_to_trim``, in both
    docstring patterns."""
    _, reference = published["taecvx"]
    model = ours["taecvx"]
    trim = model.frames_to_trim
    assert trim == 3
    clip = video("taecvx")
    _, ref_frames, *_ = encode_decode_loop(pub["base"].StreamingTAEHV, reference, clip)
    _, frames, *_ = encode_decode_loop(StreamingTAEHV, model, clip)
    assert len(frames) == len(ref_frames) - trim
    assert_same(torch.cat(frames, 1), torch.cat(ref_frames[trim:], 1), "encode/decode loop")
    z = latents(model, 3, 8)
    ref_groups, *_ = world_model_loop(pub["base"].StreamingTAEHV, reference, z)
    groups, *_ = world_model_loop(StreamingTAEHV, model, z)
    assert_same(torch.cat(sum(groups, []), 1), torch.cat(sum(ref_groups, [])[trim:], 1), "world model loop")


@torch.no_grad()
def test_stream_is_a_module(published):
    """Published ``StreamingTAEHV`` is an ``nn.Module`` wrapping the TAEHV, so
    ``StreamingTAEHV(taehv).to(device, dtype).eval()`` works and moves the model."""
    streaming = StreamingTAEHV(TAEHV(checkpoint_path=published["taehv"][0]))
    streaming = streaming.to("cpu", torch.float64).eval()
    assert streaming.taehv.encoder[0].weight.dtype == torch.float64
