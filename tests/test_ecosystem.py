"""The export bundle as other tools read it: ComfyUI's and LightX2V's detection rules
emulated here from their sources (cited per rule), and the published ``taehv.py`` itself
loading the ``.pth`` by its name. Each exported TAE is taken as the right model in its
latent space, or its model card says that a tool takes it for another and what to use."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from bench.lib.harness import load_published, published_file
from comfyui_rules import comfyui_takes
from taehv_train.base.errors import UserError
from taehv_train.models.taehv import TAEHV
from taehv_train.models.weights import save_weights
from taehv_train.training.export import write_bundle


def lightx2v_space(file_name: str, variant: str) -> str:
    """The latents LightX2V hands a Wan TAE: raw when its path contains "lighttae"
    (lightx2v/pipeline.py L312-313, need_scaled), else the runner's normalised ones."""
    return "raw" if "lighttae" in file_name else "normalised"


# variant, the space it was trained in -> the bundle's stem, ComfyUI's reading of <stem>.safetensors,
# whether that reading is right, LightX2V's space for it (None: no LightX2V TAE for the model)
CASES = [
    ("taehv", "scaled", "taehv", ("relu", "HunyuanVideo"), True, None),
    ("taecvx", "raw", "taecvx", ("relu", "none"), True, None),
    ("taew2_1", "normalised", "taew2_1", ("relu", "none"), False, "normalised"),
    ("taew2_1", "raw", "lighttaew2_1", ("relu", "none"), True, "raw"),
    ("lighttaew2_2", "raw", "lighttaew2_2", ("relu", "none"), True, "raw"),
    ("taehv1_5", "scaled", "taehv1_5", ("leaky_relu", "HunyuanVideo15"), False, None),
    ("lighttaehy1_5", "raw", "lighttaehy1_5", ("leaky_relu", "HunyuanVideo15"), False, None),
    ("taeltx2_3", "normalised", "taeltx2_3", ("relu", "none"), True, None),
]


@pytest.fixture(scope="module")
def published_taehv():
    """madebyollin's taehv.py (``../shared/reference``), imported by path."""
    path = published_file()
    if not path.is_file():
        pytest.fail(f"the published taehv.py is missing at {path}")
    return load_published(path)


@pytest.mark.parametrize("variant, space, stem, comfyui, comfyui_right, lightx2v", CASES, ids=[c[2] for c in CASES])
def test_an_export_is_named_and_typed_for_the_loaders_that_read_it(
    tmp_path, published_taehv, variant, space, stem, comfyui, comfyui_right, lightx2v
):
    torch.manual_seed(0)
    model = TAEHV(variant=variant)
    model.latent_space = space
    write_bundle(save_weights(model, tmp_path / "weights.safetensors"), tmp_path / "out")
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == sorted(["README.md", f"{stem}.pth", f"{stem}.safetensors"])
    comfy_file = load_file(str(out / f"{stem}.safetensors"))
    assert comfyui_takes(comfy_file) == comfyui
    card = (out / "README.md").read_text()
    comfy_line = next(line for line in card.splitlines() if line.startswith(f"- ComfyUI takes `{stem}.safetensors`"))
    assert ("the right model" in comfy_line) == comfyui_right, comfy_line
    if not comfyui_right:
        assert "TAEVideoVAE.from_file" in comfy_line
        assert ("not this network" in comfy_line) == (comfyui[0] != model.activation)
    if lightx2v is not None:
        assert lightx2v_space(f"{stem}.safetensors", variant) == lightx2v == space
        assert f"- LightX2V takes `{stem}.safetensors`" in card
    assert f"Latent space: {space} latents" in card
    ours = {suffix: TAEHV(out / f"{stem}{suffix}") for suffix in (".pth", ".safetensors")}
    for tae in ours.values():  # by name or metadata: the same space
        assert tae.latent_space == space
    if model.activation == "relu":  # the published file builds the architecture from the name and loads strictly
        published = published_taehv.TAEHV(str(out / f"{stem}.pth")).eval()
        latents = torch.randn(1, 2, model.latent_channels, 2, 2)
        with torch.no_grad():
            torch.testing.assert_close(
                published.decode_video(latents, parallel=True, show_progress_bar=False),
                ours[".pth"].eval().decode_video(latents),
                atol=1e-5,
                rtol=1e-5,
            )


def test_weights_beyond_fp16_are_refused_before_any_fp16_file_is_written(tmp_path):
    """taehv's ComfyUI file is fp16 (ComfyUI's rule for HunyuanVideo's scale), and --fp16
    writes one for every TAE: weights of 1e6 or -7e4 would become inf there."""
    for variant, space, fp16 in (("taehv", "scaled", False), ("taecvx", "raw", True)):
        model = TAEHV(variant=variant)
        model.latent_space = space
        with torch.no_grad():
            model.decoder[1].weight[0, 0, 0, 0] = 1e6
            model.decoder[1].weight[0, 0, 0, 1] = -7e4
        weights = save_weights(model, tmp_path / f"{variant}_weights.safetensors")
        with pytest.raises(UserError, match=r"1 tensor\(s\) do not fit fp16 \(e.g. decoder.1.weight; largest"):
            write_bundle(weights, tmp_path / variant, fp16=fp16)
        assert not (tmp_path / variant).exists()
