"""LightX2V's LightTAE weights (``lighttaew2_1``, ``lighttaew2_2``, ``lighttaehy1_5``).

lighttaew2_1 / lighttaew2_2 are taew2_1's / taew2_2's networks (the same keys; only their
latent space differs). lighttaehy1_5 is taehv1_5's network with LeakyReLU(0.2) for every
ReLU, on pixels in [-1, 1] both ways (LightX2V's ``tae.py``, ComfyUI's ``taehv.py``). Its
reference here is the published ``taehv.py`` (imported by path, as tests/test_dropin.py
does) built as taehv1_5 with its ReLUs swapped for LeakyReLU(0.2), fed ``x * 2 - 1`` (as
ComfyUI feeds it), its decoder output clamped to [-1, 1] (as LightX2V does) and mapped back
by ``(y + 1) / 2``: our model takes and gives [0, 1] like every other variant.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from test_dropin import (
    assert_not_saturated,
    assert_same,
    encode_decode_loop,
    published_training_forward,
    save_fresh_published,
)

from bench.lib.harness import load_published, published_file
from conftest import _require, shared_dir
from taehv_train.models import fast_paths
from taehv_train.models.taehv import TAEHV, StreamingTAEHV
from taehv_train.models.variants import custom_spec, detect_variant
from taehv_train.models.weights import read_metadata, save_weights

FRAMES, SIDE = 5, 16  # two latents; H and W multiples of 8 * patch size 2


@pytest.fixture(scope="module")
def published():
    _require(shared_dir() / "reference", "published taehv.py")
    return load_published(published_file())


def leaky(model: nn.Module) -> nn.Module:
    """``model`` with every nn.ReLU replaced by nn.LeakyReLU(0.2), in place."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.ReLU):
                setattr(module, name, nn.LeakyReLU(0.2))
    return model


@pytest.fixture(scope="module")
def hy15(published, tmp_path_factory):
    """(ours, reference) on the same fresh weights: ours loads ``lighttaehy1_5.pth`` by its
    name; the reference is the published taehv1_5, leaky, clamping to [-1, 1]."""
    root = tmp_path_factory.mktemp("lighttae")
    path = save_fresh_published(published, root / "taehv1_5.pth", seed=5)
    reference = leaky(published.TAEHV(path)).eval()
    reference.postprocess_output_frames = lambda x: F.pixel_shuffle(x, 2).clamp_(-1, 1)  # LightX2V's clamp
    return TAEHV(shutil.copy(path, root / "lighttaehy1_5.pth")).eval(), reference


def clip(seed: int = 0) -> torch.Tensor:
    return torch.rand(1, FRAMES, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
@torch.no_grad()
def test_lighttaehy1_5_is_the_leaky_published_network_on_signed_pixels(parallel, hy15):
    """Encode and decode equal the reference within fp32 rounding, in parallel and
    sequential mode and streaming; the fast paths, which fold ReLUs, are not taken."""
    model, reference = hy15
    assert (model.variant, model.activation, model.signed_pixels) == ("lighttaehy1_5", "leaky_relu", True)
    assert (model.patch_size, model.latent_channels) == (2, 32)
    assert model.state_dict().keys() == reference.state_dict().keys()
    assert (
        fast_paths.choose(model.encoder, torch.zeros(1, 4, 12, SIDE // 2, SIDE // 2), None, keep_weights=False) is None
    )
    x = clip()
    z = reference.encode_video(x * 2 - 1, parallel, show_progress_bar=False)
    assert_same(model.encode_video(x, parallel), z, "encode_video")
    expected = (reference.decode_video(z, parallel, show_progress_bar=False) + 1) / 2
    assert_not_saturated(expected)
    assert_same(model.decode_video(z, parallel), expected, "decode_video")
    if parallel:
        _, frames, *_ = encode_decode_loop(StreamingTAEHV, model, x)
        assert_same(torch.cat(frames, 1), model.decode_video(model.encode_video(x)), "streamed frames")


def test_lighttaehy1_5_training_gradients_are_the_reference_ones(hy15, published):
    """The unclamped training forward and every parameter's gradient: equal to the
    reference's in float64 (1e-10), and as close as float rounding allows in float32 (1e-3
    of each gradient's norm), as tests/test_dropin.py checks the ReLU variants."""
    model, reference = hy15
    x = clip(seed=3).expand(2, -1, -1, -1, -1).contiguous()
    x[1] = x[1].flip(-1)

    def gradients(net, forward, dtype):
        net = copy.deepcopy(net).to(dtype).train()
        z, decoded = forward(net, x.to(dtype))
        loss = F.mse_loss(decoded, x[:, : decoded.shape[1]].to(dtype)) + z.square().mean()
        loss.backward()
        return loss.detach(), {key: p.grad for key, p in net.named_parameters()}

    def reference_forward(net, x):
        z, decoded = published_training_forward(published, net, x * 2 - 1)
        return z, (decoded + 1) / 2

    def ours_forward(net, x):
        z = net.encode_video(x)
        return z, net.decode_video(z, clamp=False)

    loss64, expected = gradients(reference, reference_forward, torch.float64)
    for dtype, tolerance in ((torch.float64, 1e-10), (torch.float32, 1e-3)):
        loss, got = gradients(model, ours_forward, dtype)
        torch.testing.assert_close(loss.double(), loss64, rtol=tolerance, atol=0)
        for key, grad in expected.items():
            error = ((got[key].double() - grad).norm() / grad.norm()).item()
            assert error < tolerance, f"{dtype} gradient of {key}: relative error {error:.2e}"


@pytest.fixture(scope="module")
def fresh_models():
    """Fresh taew2_x models by name, each built once (seed 0) and only read."""
    models = {}

    def fresh(variant: str) -> TAEHV:
        if variant not in models:
            torch.manual_seed(0)
            models[variant] = TAEHV(variant=variant).eval()
        return models[variant]

    return fresh


@pytest.mark.parametrize("light, base", [("lighttaew2_1", "taew2_1"), ("lighttaew2_2", "taew2_2")])
@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
@torch.no_grad()
def test_lighttaew2_files_load_by_name_into_the_taew2_network(light, base, suffix, tmp_path, fresh_models):
    """A taew2_x model's weights saved as ``lighttaew2_x.pth`` (``save_weights``) or as a
    ``.safetensors`` without our metadata (as LightX2V publishes it) load by file name into
    the light variant: the same keys, the same weights, the same frames."""
    model = fresh_models(base)
    path = tmp_path / f"{light}{suffix}"
    if suffix == ".pth":
        save_weights(model, path)
    else:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    assert detect_variant(path) == light
    loaded = TAEHV(path).eval()
    assert (loaded.variant, loaded.activation, loaded.signed_pixels) == (light, "relu", False)
    assert not any(isinstance(m, nn.LeakyReLU) for m in loaded.modules())
    with torch.device("meta"):  # the light network's keys and shapes; its own weights are not needed
        TAEHV(variant=light).load_state_dict(model.state_dict(), strict=True, assign=True)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
    z = torch.randn(1, 2, model.latent_channels, 2, 2, generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded.decode_video(z), model.decode_video(z))


def test_file_names_pick_the_light_variants():
    """The longest variant name in a file name wins: LightX2V's names over the published ones."""
    names = {
        "lighttaew2_1.safetensors": "lighttaew2_1",
        "lighttaew2_2.pth": "lighttaew2_2",
        "lighttaehy1_5.safetensors": "lighttaehy1_5",
        "taew2_1.safetensors": "taew2_1",
        "taehv1_5.pth": "taehv1_5",
    }
    assert {name: detect_variant(f"/ckpt/{name}") for name in names} == names


@torch.no_grad()
def test_activation_and_signed_pixels_round_trip_through_metadata(tmp_path):
    """A renamed ``.safetensors`` export of lighttaehy1_5 loads as it (the metadata names
    it); under a variant name this version does not know, the model is built from the
    metadata alone, LeakyReLU and signed pixels included; files without the two keys are
    ReLU on [0, 1]."""
    torch.manual_seed(0)
    model = TAEHV(variant="lighttaehy1_5").eval()
    path = save_weights(model, tmp_path / "my_model.safetensors")
    metadata = read_metadata(path)
    assert (metadata["activation"], metadata["signed_pixels"]) == ("leaky_relu", "true")
    x = clip()
    expected = model.decode_video(model.encode_video(x))
    future = tmp_path / "future.safetensors"
    save_file(dict(model.state_dict()), str(future), metadata={**metadata, "variant": "lighttae_from_the_future"})
    for file, name in ((path, "lighttaehy1_5"), (future, "lighttae_from_the_future")):
        loaded = TAEHV(file).eval()
        assert (loaded.variant, loaded.activation, loaded.signed_pixels) == (name, "leaky_relu", True)
        assert any(isinstance(m, nn.LeakyReLU) for m in loaded.modules())
        assert torch.equal(loaded.decode_video(loaded.encode_video(x)), expected)
    old = {k: v for k, v in metadata.items() if k not in ("activation", "signed_pixels")}
    assert (custom_spec(old).activation, custom_spec(old).signed_pixels) == ("relu", False)
