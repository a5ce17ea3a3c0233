"""Our TAEHV against the published architecture (../shared/compat fixtures).

Each variant's deterministic recipe weights are saved under the file name users give
the published weights and loaded through the normal constructor, so file-name variant
detection is exercised too; outputs must match the reference within 1e-4.
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file

from models.taehv import TAEHV

ATOL = 1e-4


@pytest.fixture(scope="module")
def compat(compat_dir):
    spec = importlib.util.spec_from_file_location("compat_recipe", compat_dir / "recipe.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    manifest = json.loads((compat_dir / "manifest.json").read_text())
    expected = load_file(str(compat_dir / "expected.safetensors"))
    return recipe, manifest, expected


def _case_names(compat_dir_path):
    manifest = json.loads((compat_dir_path / "manifest.json").read_text())
    return [c["name"] for c in manifest["cases"]]


def pytest_generate_tests(metafunc):
    if "case_name" in metafunc.fixturenames:
        from conftest import shared_dir

        path = shared_dir() / "compat"
        names = _case_names(path) if path.exists() else ["fixtures-missing"]
        metafunc.parametrize("case_name", names)


@pytest.fixture(scope="module")
def weight_files(compat, tmp_path_factory):
    """Recipe weights of every variant, saved as users name the published files."""
    recipe, manifest, _ = compat
    root = tmp_path_factory.mktemp("published")
    files = {}
    for name, variant in manifest["variants"].items():
        sd = recipe.recipe_state_dict(variant["state_dict"], **manifest["recipe"])
        path = root / (variant["checkpoint_file_name"] or f"{name}.pth")
        torch.save(sd, path)
        files[name] = path
    return files


def _build(variant_name, variant, path):
    if variant["checkpoint_file_name"] is None:  # constructor-only variant (preview decoder)
        return TAEHV(checkpoint_path=path, **variant["reference_kwargs"])
    return TAEHV(checkpoint_path=path)


@torch.no_grad()
def test_case_matches_reference(case_name, compat, weight_files):
    recipe, manifest, expected = compat
    case = next(c for c in manifest["cases"] if c["name"] == case_name)
    variant = manifest["variants"][case["variant"]]
    model = _build(case["variant"], variant, weight_files[case["variant"]]).eval()
    assert (model.patch_size, model.latent_channels, model.is_cogvideox) == (
        variant["patch_size"], variant["latent_channels"], variant["is_cogvideox"])
    assert (model.t_downscale, model.t_upscale, model.frames_to_trim) == (
        variant["t_downscale"], variant["t_upscale"], variant["frames_to_trim"])
    assert sum(p.numel() for p in model.parameters()) == variant["n_params"]

    x = recipe.video_input(**case["input"])
    ref_latent = expected[f"{case_name}/latent"]
    ref_decoded = expected[f"{case_name}/decoded"]
    assert list(ref_latent.shape) == case["latent_shape"]
    for parallel in (True, False):
        latent = model.encode_video(x, parallel=parallel)
        torch.testing.assert_close(latent, ref_latent, atol=ATOL, rtol=0)
        decoded = model.decode_video(ref_latent, parallel=parallel)
        torch.testing.assert_close(decoded, ref_decoded, atol=ATOL, rtol=0)

    plan = model.plan(case["input"]["t"])
    assert (plan.latent_frames, plan.decoded_frames) == (case["latent_shape"][1], case["decoded_shape"][1])

    if f"{case_name}/streamed" in expected:
        stream = model.stream()
        frames = []
        for t in range(x.shape[1]):
            for latent in stream.encode(x[:, t : t + 1]):
                frames += stream.decode(latent)
        frames += stream.flush()
        torch.testing.assert_close(torch.cat(frames, 1), expected[f"{case_name}/streamed"], atol=ATOL, rtol=0)
