"""Every path by which ComfyUI decodes an exported TAE, emulated from its sources
(``comfyui_rules``): its live preview (``latent_preview.py``: the file it takes from
``models/vae_approx`` by name, the sampler's first latent frame through the model's
``process_out``, then the file's own format) and VAEDecode (ComfyUI's LATENT through the
file's own format). Per exported family, the file decodes what ComfyUI hands it exactly
as the TAE decodes the same latents in its own space, where the model card says it is the
right model, and differently where the card says it is not; a Wan TAE trained with
``--latent_space=raw`` is the one that takes Wan's preview route."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from comfyui_rules import (
    FORMATS,
    PREVIEW_NAMES,
    WAN21_MEAN,
    WAN21_STD,
    WAN22_MEAN,
    WAN22_STD,
    comfyui_takes,
    load_torch_file,
    preview_latents,
    previewer_file,
)
from conftest import save_tiny_vae, tool_exit
from taehv_train.models.latent_spaces import NORMALISED, RAW, SCALED, LatentTransform
from taehv_train.models.taehv import TAEHV
from taehv_train.models.vae_registry import class_defaults, spaces_of
from taehv_train.models.weights import save_weights
from taehv_train.training import export
from taehv_train.training.ecosystem import comfyui_model, comfyui_preview, comfyui_reading
from train_runs import train_here

IDENTITY = LatentTransform(RAW)


def own_space(statistics: str) -> LatentTransform:
    """ComfyUI's LATENT of the model -> the TAE's own space: the package's statistics of the
    reference VAE (Wan 2.2's as ComfyUI lists them: diffusers' class defaults are Wan 2.1's);
    the identity where the LATENT is already the TAE's space."""
    if statistics == "wan22":
        return LatentTransform(NORMALISED, mean=WAN22_MEAN, std=WAN22_STD)
    if statistics == "none":
        return IDENTITY
    ref_vae_class, space = statistics.split(":")
    return spaces_of(ref_vae_class, class_defaults(ref_vae_class))[space]


# variant, the space it was trained in, ComfyUI's latent format of its model, ComfyUI's LATENT -> the TAE's
# space (own_space), whether ComfyUI's live preview has a file of the bundle that decodes right
CASES = [
    ("taehv", SCALED, "HunyuanVideo", "hunyuan:scaled", True),
    ("taew2_1", NORMALISED, "Wan21", "wan:normalised", False),
    ("taew2_1", RAW, "Wan21", "none", True),
    ("taew2_2", NORMALISED, "Wan22", "wan22", False),
    ("lighttaew2_2", RAW, "Wan22", "none", True),
    ("taehv1_5", SCALED, "HunyuanVideo15", "hunyuan15:scaled", False),
    ("lighttaehy1_5", RAW, "HunyuanVideo15", "none", False),
    ("taeh3", NORMALISED, "MiniMaxH3Video", "none", True),  # ComfyUI's H3 LATENT is normalised
    ("taeltx2_3", NORMALISED, "LTXV", "none", False),  # its LATENT is normalised; no TAE preview
    ("taecvx", RAW, "CogVideoX", "none", False),  # no TAE preview
]
# what ComfyUI's TAEHV builds for a file, by its shapes (comfy/sd.py, comfyui_rules.comfyui_takes): as a variant
NETWORK = {16: "taehv", 24: "taeh3", 32: "lighttaehy1_5", 48: "taew2_2", 128: "taeltx2_3"}


def comfyui_network(path: Path) -> tuple[TAEHV, str, torch.dtype]:
    """The network ComfyUI builds from an exported file (the architecture it picks by the
    tensors' shapes, holding the file's tensors), the latent format it gives it and the
    file's dtype."""
    tensors = load_torch_file(path)
    activation, latent_format = comfyui_takes(tensors)
    with torch.device("meta"):
        network = TAEHV(variant=NETWORK[tensors["decoder.1.weight"].shape[1]])
    network.load_state_dict(tensors, assign=True)
    assert network.activation == activation
    return network.float().eval(), latent_format, tensors["decoder.1.weight"].dtype


@pytest.mark.parametrize(
    "variant, space, model_format, statistics, previews", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_the_exported_file_decodes_what_comfyuis_preview_and_vaedecode_hand_it(
    tmp_path, variant, space, model_format, statistics, previews
):
    """ComfyUI's LATENT goes into the sampler's space (the model's ``process_in``); the
    preview takes its first latent frame back out (``process_out``) and VAEDecode the LATENT
    as it is; each file's VAE applies its own format. A file is the right model where it
    gets the TAE's own-space latents and has the TAE's network: then it decodes them as
    the TAE does, and only then does the card say so."""
    torch.manual_seed(0)
    tae = TAEHV(variant=variant)
    tae.latent_space = space
    out = tmp_path / "out"
    export.write_bundle(save_weights(tae, tmp_path / "weights.safetensors"), out, tell=lambda line: None)
    names, card = sorted(p.name for p in out.iterdir()), (out / "README.md").read_text()
    model = comfyui_model(variant)
    assert model.latent_format == model_format
    to_own = own_space(statistics)
    if statistics == "wan:normalised":  # the package's Wan statistics are those ComfyUI's Wan21 format uses
        assert (to_own.mean, to_own.std) == (WAN21_MEAN, WAN21_STD)
    latent = torch.randn(1, 3, tae.latent_channels, 1, 1) * 2 + 0.5  # ComfyUI's LATENT: three latent frames
    x0 = FORMATS[model_format].process_in(latent)  # the sampler's denoised estimate, in the model's space
    networks = {name: comfyui_network(out / name) for name in names if name != "README.md"}

    def decodes_as_the_tae(name: str, handed: torch.Tensor, own: torch.Tensor) -> bool:
        network, file_format, dtype = networks[name]
        given = FORMATS[file_format].process_in(handed)
        if network.activation != tae.activation or not torch.allclose(given, own, atol=1e-5, rtol=1e-5):
            assert network.activation != tae.activation or float((given - own).abs().max()) > 0.01
            return False
        with torch.no_grad():
            tolerance = 1e-2 if dtype == torch.float16 else 1e-5
            torch.testing.assert_close(
                network.decode_video(given), tae.eval().decode_video(own), atol=tolerance, rtol=0
            )
        return True

    for name in (n for n in names if n.endswith(".safetensors")):  # VAEDecode, as the package reads each file
        reading = comfyui_reading(tae.latent_channels, 3 * tae.patch_size**2, networks[name][2], variant)
        right = decodes_as_the_tae(name, latent, to_own.to_tae(latent))
        assert right == (reading.space == space and reading.activation == tae.activation), name
        line = next(line for line in card.splitlines() if line.startswith(f"- ComfyUI takes `{name}`"))
        assert line.endswith("the right model.") == right, line

    taken = previewer_file(names, model_format)
    preview = comfyui_preview(list(networks), variant)
    assert (preview.candidates[0] if preview and preview.candidates else None) == taken
    preview_line = next(line for line in card.splitlines() if line.startswith("- ComfyUI's live preview"))
    for other, prefix in PREVIEW_NAMES.items():  # another model's preview taking a file by its name: said
        if other != model_format:
            assert (previewer_file(names, other) is not None) == (f"also start with `{prefix}`" in card), other
    if taken is None:
        assert ("no core ComfyUI preview route" in preview_line) == (preview is not None)
        assert ("`--latent_space=raw`" in preview_line) == model_format.startswith("Wan")
        assert not previews
        return
    handed, own_first = preview_latents(x0, model_format), to_own.to_tae(latent)[:, :1]
    right = [n for n in preview.candidates if decodes_as_the_tae(n, handed, own_first)]
    assert bool(right) == previews
    assert f"takes `{taken}`" in preview_line
    assert preview_line.endswith("the right model.") == (taken in right)
    if right and taken not in right:
        assert f"Put `{right[0]}` in `models/vae_approx` without the other files" in card


def test_export_says_a_default_space_wan_tae_has_no_core_comfyui_route(tmp_path, capsys):
    weights = save_weights(TAEHV(variant="taew2_1"), tmp_path / "taew2_1.safetensors")  # the table's space
    status, out, err = tool_exit(capsys, export.main, str(weights), "--out", str(tmp_path / "out"))
    assert status == 0, err
    told = next(line for line in out.splitlines() if line.startswith("ComfyUI's live preview"))
    assert "`models/vae_approx/lighttaew2_1*`" in told and "no core ComfyUI preview route" in told
    assert "trained with `--latent_space=raw` it is exported as `lighttaew2_1`" in told


@pytest.mark.slow  # a training run (about 15 s on 2 cores): the flag's whole path, from config to export
def test_a_wan_tae_trained_with_latent_space_raw_takes_comfyuis_lighttaew2_route(tmp_path, demo_clips):
    root = save_tiny_vae(tmp_path / "wan", "wan")
    run = train_here(
        tmp_path / "run",
        demo_clips,
        f"--ref_vae_path={root}",
        "--ref_vae_class=wan",
        "--ref_vae_dtype=fp32",
        "--variant=taew2_1",
        "--latent_space=raw",
        "--height=32",
        "--width=32",
        "--n_frames=9",
        "--stride_max=1",
        "--max_train_steps=1",
        "--num_validation_samples=1",
        "--mixed_precision=no",
    )
    assert json.loads((run / "config.json").read_text())["latent_space"] == RAW
    names = sorted(p.name for p in (run / "export").iterdir())
    assert names == ["README.md", "lighttaew2_1.pth", "lighttaew2_1.safetensors"]
    assert previewer_file(names, "Wan21") == "lighttaew2_1.pth"
    trained = TAEHV(run / "export" / "lighttaew2_1.safetensors").eval()
    assert trained.latent_space == RAW
    network, file_format, _ = comfyui_network(run / "export" / "lighttaew2_1.pth")
    latent = torch.randn(1, 3, 16, 1, 1) * 2 + 0.5  # ComfyUI's Wan LATENT: raw
    handed = preview_latents(FORMATS["Wan21"].process_in(latent), "Wan21")
    with torch.no_grad():
        torch.testing.assert_close(
            network.decode_video(FORMATS[file_format].process_in(handed)),
            trained.decode_video(latent[:, :1]),
            atol=1e-5,
            rtol=1e-5,
        )
    card = (run / "export" / "README.md").read_text()
    assert "takes `lighttaew2_1.pth`" in card and "raw latents: the right model." in card
    assert "ComfyUI's live preview of Wan 2.1 (Wan21) takes `lighttaew2_1.pth`" in (run / "train.log").read_text()
