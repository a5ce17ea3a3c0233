"""Each TAE lives in the latent space its published weights use (models/latent_spaces.py):
the table, the conversion every consumer shares (training targets, the latent cache,
validation, ``inference.py --use_ref_vae``, the diffusers wrapper), and the classifier
that says which space a latent tensor looks like. Per family, a tiny real diffusers VAE
with statistics that are not trivial, and the published convention built by hand from
the table's space."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import TINY_VAES, save_tiny_vae
from taehv_train import inference
from taehv_train.base.errors import UserError
from taehv_train.common.clips import frames_to_unit
from taehv_train.common.reference_vae import ReferenceVAE
from taehv_train.models.diffusers_vae import TAEVideoVAE
from taehv_train.models.latent_spaces import (
    NORMALISED,
    NORMALISED_SCALED,
    RAW,
    SCALED,
    TAE_SPACES,
    guess_space,
    published_space,
)
from taehv_train.models.taehv import TAEHV
from taehv_train.models.unloaded_references import published_transform
from taehv_train.models.vae_classes import REF_VAE_CLASSES
from taehv_train.models.vae_registry import class_defaults, file_space, spaces_of, tae_space
from taehv_train.models.variants import BASE_VARIANTS, LIGHT_VARIANTS, OTHER_VARIANTS, SUPER_SUFFIX
from taehv_train.models.weights import save_weights
from taehv_train.training import which_latents
from taehv_train.training.data.loading import ReferenceLatents

# tiny VAE (conftest.TINY_VAES), ref_vae_class, the TAE, its space (the table's, written out), size, frames
FAMILIES = [
    ("cogvideox", "cogvideox", "taecvx", RAW, 32, 9),
    ("hunyuan", "hunyuan", "taehv", SCALED, 32, 9),
    ("hunyuan15", "hunyuan15", "taehv1_5", SCALED, 32, 9),
    ("hunyuan15", "hunyuan15", "lighttaehy1_5", RAW, 32, 9),
    ("wan", "wan", "taew2_1", NORMALISED, 32, 9),
    ("wan", "wan", "lighttaew2_1", RAW, 32, 9),
    ("wan22", "wan", "taew2_2", NORMALISED, 32, 9),
    ("ltx", "ltx", "taeltx_2", NORMALISED, 32, 9),
    ("ltx2", "ltx2", "taeltx2_3", NORMALISED, 64, 9),
    ("h3", "h3", "taeh3", NORMALISED, 32, 22),
    ("allegro", "allegro", "tae_allegro", SCALED, 32, 24),
    ("cosmos", "cosmos", "tae_cosmos", NORMALISED_SCALED, 32, 9),
    ("kvae", "kvae", "tae_kvae", RAW, 32, 9),
    ("easyanimate", "easyanimate", "tae_easyanimate", SCALED, 32, 9),
    ("vidtok", "vidtok", "tae_vidtok", RAW, 32, 9),
    ("mochi", "mochi", "tae_mochi", NORMALISED_SCALED, 32, 7),
    ("svd", "svd", "tae_svd", SCALED, 32, 3),
    ("hunyuanimage_refiner", "hunyuanimage_refiner", "tae_hunyuanimage_refiner", SCALED, 32, 3),
    ("qwenimage21", "qwenimage21", "tae_qwenimage2_1", NORMALISED, 32, 1),
]


def statistics_overrides(tiny: str, channels: int) -> dict:
    """Per-channel statistics far from 0 and 1 where conftest's tiny VAE has trivial ones."""
    if "latents_mean" not in TINY_VAES[tiny]:
        return {}
    return {
        "latents_mean": [0.3 * i / channels - 0.5 for i in range(channels)],
        "latents_std": [0.5 + 2.0 * i / channels for i in range(channels)],
    }


def tiny_vae(root, tiny: str, ref_vae_class: str, channels: int):
    """The tiny VAE saved and loaded back by diffusers; LTX's statistics are buffers in its
    weights, set and saved again."""
    path = save_tiny_vae(root, tiny, **statistics_overrides(tiny, channels))
    cls = REF_VAE_CLASSES[ref_vae_class]
    if ref_vae_class in ("ltx", "ltx2"):
        import diffusers

        vae = getattr(diffusers, cls.diffusers_class).from_pretrained(path / "vae")
        vae.latents_mean.copy_(torch.linspace(-0.4, 0.4, channels))
        vae.latents_std.copy_(torch.linspace(0.5, 2.5, channels))
        vae.save_pretrained(path / "vae")
    return path


def by_hand(space: str, raw: torch.Tensor, vae: torch.nn.Module, ref_vae_class: str) -> torch.Tensor:
    """The published convention of ``space`` applied to NTCHW raw latents, from the VAE's own
    config and buffers: what its pipeline hands the transformer (or, for raw, nothing)."""
    config, frames, channels = vae.config, raw.shape[1], raw.shape[2]
    if space == RAW:
        return raw
    scale = REF_VAE_CLASSES[ref_vae_class].sampler_scale or config.get("scaling_factor")  # Cosmos: sigma_data
    if space == SCALED:
        return raw * scale
    buffers = dict(vae.named_buffers())  # LTX keeps them in its weights, the others in their config
    mean, std = (buffers.get(key, torch.tensor(config.get(key) or [])) for key in ("latents_mean", "latents_std"))
    # per channel, or per channel and latent frame (Cosmos), as the pipelines view them
    mean, std = (s.float().view(channels, -1)[:, :frames].T.reshape(1, -1, channels, 1, 1) for s in (mean, std))
    normalised = (raw - mean) / std
    return normalised if space == NORMALISED else normalised * scale


def test_every_published_variant_has_a_row_with_evidence():
    published = [*BASE_VARIANTS, *OTHER_VARIANTS, *LIGHT_VARIANTS]
    assert all(published_space(name) is not None for name in published)
    assert published_space("taew2_2" + SUPER_SUFFIX) == TAE_SPACES["taew2_2"]  # a super decoder: its base's
    assert all(row.evidence and row.certainty in ("shown", "loaders", "stated") for row in TAE_SPACES.values())
    assert all(ref.pipeline_space in (RAW, SCALED, NORMALISED, NORMALISED_SCALED) for ref in REF_VAE_CLASSES.values())


def test_a_tae_without_a_reference_vae_has_a_space_of_its_own_and_old_files_hold_raw_latents():
    assert tae_space("taew2_1", None) == "own"
    assert file_space("taew2_1", None) == (NORMALISED, None)  # a published .pth: the table's
    assert file_space("tae_mochi", None) == (NORMALISED_SCALED, None)  # a built one: its pipeline's
    assert file_space("custom", None) == (None, None)
    assert file_space("taew2_1", {"format": "taehv", "variant": "taew2_1"}) == (RAW, None)  # ours, before spaces


def docs_space_rows() -> dict[str, tuple[str, str]]:
    """docs/reference_vaes.md's table of the published weights: each name -> (space, how sure)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "reference_vaes.md").read_text()
    table = text[text.index("| weights | space | evidence | how sure |") :].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        for name in re.findall(r"`([^`]+)`", cells[0]):
            rows[name] = (cells[1].split()[0], cells[-1])
    return rows


def test_the_docs_table_of_published_weights_is_the_table_in_the_code():
    assert docs_space_rows() == {name: (row.space, row.certainty) for name, row in TAE_SPACES.items()}


def test_taeos1_3_maps_raw_latents_with_open_sora_1_3s_video_statistics():
    transform = published_transform("taeos1_3")
    assert transform.space == TAE_SPACES["taeos1_3"].space == NORMALISED
    assert published_transform("taeos1_3" + SUPER_SUFFIX) == transform and published_transform("taew2_1") is None
    # hpcaitech/Open-Sora v1.3 opensora/models/vae_v1_3/constants.py VAE_STAT_DICT["video"]:
    # 16 values each, the first and last channels' at lines 178, 193 (mean) and 196, 211 (std)
    assert len(transform.mean) == len(transform.std) == 16
    assert (transform.mean[0], transform.mean[15]) == (-0.19016949832439423, -0.023072388023138046)
    assert (transform.std[0], transform.std[15]) == (0.9490776062011719, 0.9473513960838318)
    raw = torch.randn(1, 3, 16, 2, 2) * 2 + 0.5
    mean, std = (torch.tensor(v).view(1, 1, 16, 1, 1) for v in (transform.mean, transform.std))
    # vae.py normalize_z (lines 118-125): (z - mean) / std per channel; un_normalize_z (197-204): z * std + mean
    assert torch.allclose(transform.to_tae(raw), (raw - mean) / std)
    assert torch.allclose(transform.to_raw((raw - mean) / std), raw, atol=1e-6)
    assert file_space("taeos1_3", None) == (NORMALISED, transform)  # the published file carries them
    assert TAEHV(variant="taeos1_3").latent_transform == transform


@pytest.fixture(scope="module")
def tiny_vaes(tmp_path_factory):
    """``tiny_vae`` folders by tiny VAE, each saved once (two TAEs share Wan's and
    HunyuanVideo 1.5's) and only read."""
    roots = {}

    def root(tiny: str, ref_vae_class: str, channels: int):
        key = (tiny, ref_vae_class, channels)
        if key not in roots:
            roots[key] = tiny_vae(tmp_path_factory.mktemp(tiny), *key)
        return roots[key]

    return root


@pytest.mark.parametrize("tiny, ref_vae_class, variant, space, size, frames", FAMILIES, ids=[f[2] for f in FAMILIES])
def test_every_consumer_sees_the_latents_of_the_taes_space(
    tmp_path, tiny_vaes, tiny, ref_vae_class, variant, space, size, frames
):
    """ReferenceVAE (what training targets, the latent cache, validation and inference
    encode with) gives the table's space built by hand from the VAE's config; inference
    asks for the model's space; the wrapper in a pipeline hands the TAE the same latents
    from the raw ones ``vae.decode`` gets."""
    tae = TAEHV(variant=variant)
    assert tae_space(variant, ref_vae_class) == tae.latent_space == space
    root = tiny_vaes(tiny, ref_vae_class, tae.latent_channels)
    raw_vae = ReferenceVAE(root, ref_vae_class, dtype="fp32", sample=False)  # the VAE's own latents
    vae = ReferenceVAE.for_variant(variant, root, ref_vae_class, dtype="fp32", sample=False)
    assert vae.transform.space == space
    clip = frames_to_unit(torch.randint(0, 255, (1, frames, tae.image_channels, size, size), dtype=torch.uint8), "cpu")
    raw = raw_vae.encode(clip)
    expected = by_hand(space, raw, raw_vae.vae, ref_vae_class)
    if space != RAW:
        assert (expected - raw).abs().max() > 0.05  # the statistics matter here
    torch.testing.assert_close(vae.encode(clip), expected, atol=1e-5, rtol=1e-5)
    targets = ReferenceLatents(vae, cached=False)({}, clip, torch.Generator())  # the training step's
    torch.testing.assert_close(targets, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vae.decode(expected), raw_vae.decode(raw), atol=1e-4, rtol=0)

    weights = save_weights(tae, tmp_path / f"{variant}.safetensors")
    wrapper = TAEVideoVAE.from_file(weights, like=raw_vae.vae)
    args = argparse.Namespace(config=None, ref_vae_path=str(root), ref_vae_class=ref_vae_class, dtype="fp32")
    assert inference.reference_vae(args, None, wrapper.tae, "cpu").transform == vae.transform  # the file's TAE

    latents = raw.permute(0, 2, 1, 3, 4)  # NCTHW, what the pipeline passes vae.decode
    if wrapper.images:  # SVD: frame latents and num_frames
        decoded = wrapper.decode(raw.flatten(0, 1), num_frames=raw.shape[1]).sample.unflatten(0, (1, -1))
    else:
        decoded = wrapper.decode(latents).sample
        decoded = decoded if wrapper.frames_first else decoded.permute(0, 2, 1, 3, 4)
    direct = wrapper.tae.decode_video(expected).mul(2).sub(1)
    torch.testing.assert_close(decoded, direct, atol=1e-5, rtol=0)


def test_a_cache_of_raw_latents_from_before_spaces_were_recorded_is_read_by_its_space(tmp_path):
    """A manifest without latent_space holds raw latents: valid for a raw TAE (taecvx),
    refused with the rebuild command for a normalised one."""
    import json

    from taehv_train.training.data.latent_cache import CACHE_MANIFEST, differences, read_cache_manifest

    (tmp_path / CACHE_MANIFEST).write_text(json.dumps({"format": 1, "valid_for": {"epochs": 1}}))
    manifest = read_cache_manifest(tmp_path)
    assert differences(manifest["valid_for"], {"epochs": 1, "latent_space": RAW}) == []
    assert differences(manifest["valid_for"], {"epochs": 1, "latent_space": NORMALISED}) == [
        "latent_space: cache 'raw', now 'normalised'"
    ]


def test_the_classifier_tells_normalised_wan_latents_from_raw_ones(tmp_path, capsys):
    """``python -m taehv_train.training.which_latents`` (``guess_space``, as the latent-scale check)
    with Wan 2.1's released statistics (the class defaults): latents like madebyollin's
    examples/test_latents_wan.pth (NCTHW, per-channel std 0.6-1.2, means up to 0.8) look
    normalised, the same latents un-normalised look raw; for CogVideoX (scaling factor 1.15)
    raw and scaled latents cannot be told apart."""
    unit = torch.randn(1, 9, 16, 8, 8, generator=torch.Generator().manual_seed(0))  # NTCHW
    wan_like = unit * torch.linspace(0.6, 1.2, 16).view(1, 1, 16, 1, 1) + torch.linspace(-0.6, 0.8, 16).view(
        1, 1, 16, 1, 1
    )
    torch.save(wan_like.transpose(1, 2).to(torch.bfloat16), tmp_path / "normalised.pth")
    assert "they look normalised" in which_latents.main([str(tmp_path / "normalised.pth"), "--ref_vae_class=wan"])
    spaces = spaces_of("wan", class_defaults("wan"))
    save_file({"latents": spaces[NORMALISED].to_raw(wan_like)}, tmp_path / "raw.safetensors")
    verdict = which_latents.main([str(tmp_path / "raw.safetensors"), "--ref_vae_class=wan", "--layout=NTCHW"])
    assert "they look raw" in verdict and verdict in capsys.readouterr().out
    cogvideox = spaces_of("cogvideox", class_defaults("cogvideox"))
    assert list(cogvideox) == [SCALED, RAW]
    guess = guess_space(unit, cogvideox)
    assert guess.best is None and "cannot be told" in guess.describe()
    with pytest.raises(UserError, match="9 channels, but the AutoencoderKLWan has 16; check --layout"):
        which_latents.main([str(tmp_path / "normalised.pth"), "--ref_vae_class=wan", "--layout=NTCHW"])
