"""Our TAEHV against the published architecture (../shared/compat fixtures, and
../shared/compat/new_variants for taeh3, taeltx2_3, taeltx2_3_wide and taew2_2_super).

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

from taehv_train.models.taehv import TAEHV
from taehv_train.models.weights import read_metadata, save_weights

ATOL = 1e-4
FIXTURE_SETS = ("", "new_variants")  # the original six variants (and a preview), then taeh3, taeltx2_3, ...


def _load(folder):
    spec = importlib.util.spec_from_file_location(
        "compat_recipe", folder.parent / "recipe.py" if folder.name == "new_variants" else folder / "recipe.py"
    )
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    manifest = json.loads((folder / "manifest.json").read_text())
    return recipe, manifest, load_file(str(folder / "expected.safetensors"))


@pytest.fixture(scope="module")
def fixture_sets(compat_dir):
    return {name: _load(compat_dir / name) for name in FIXTURE_SETS}


def pytest_generate_tests(metafunc):
    if "case_name" in metafunc.fixturenames:
        from conftest import shared_dir

        params = []
        for fixture_set in FIXTURE_SETS:
            path = shared_dir() / "compat" / fixture_set / "manifest.json"
            names = (
                [c["name"] for c in json.loads(path.read_text())["cases"]] if path.exists() else ["fixtures-missing"]
            )
            params += [(fixture_set, name) for name in names]
        metafunc.parametrize("fixture_set, case_name", params, ids=[name for _, name in params])


@pytest.fixture(scope="module")
def weight_files(fixture_sets, tmp_path_factory):
    """Recipe weights of every variant, saved as users name the published files."""
    files = {}
    for fixture_set, (recipe, manifest, _) in fixture_sets.items():
        root = tmp_path_factory.mktemp(f"published{fixture_set}")
        for name, variant in manifest["variants"].items():
            sd = recipe.recipe_state_dict(variant["state_dict"], **manifest["recipe"])
            path = root / (variant["checkpoint_file_name"] or f"{name}.pth")
            torch.save(sd, path)
            files[name] = path
    return files


@pytest.fixture(scope="module")
def loaded_models(fixture_sets, weight_files):
    """Variant name -> our TAEHV built by the normal constructor from its recipe weights file,
    once for all of its cases (they only run it)."""
    variants = {name: v for _, manifest, _ in fixture_sets.values() for name, v in manifest["variants"].items()}
    built = {}

    def model(name: str) -> TAEHV:
        if name not in built:
            kwargs = variants[name]["reference_kwargs"] if variants[name]["checkpoint_file_name"] is None else {}
            built[name] = TAEHV(checkpoint_path=weight_files[name], **kwargs).eval()  # kwargs: a preview decoder
        return built[name]

    return model


@torch.no_grad()
def test_case_matches_reference(fixture_set, case_name, fixture_sets, loaded_models):
    recipe, manifest, expected = fixture_sets[fixture_set]
    case = next(c for c in manifest["cases"] if c["name"] == case_name)
    variant = manifest["variants"][case["variant"]]
    model = loaded_models(case["variant"])
    assert (model.patch_size, model.latent_channels, model.is_cogvideox) == (
        variant["patch_size"],
        variant["latent_channels"],
        variant["is_cogvideox"],
    )
    assert (model.t_downscale, model.t_upscale, model.frames_to_trim) == (
        variant["t_downscale"],
        variant["t_upscale"],
        variant["frames_to_trim"],
    )
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

    with torch.enable_grad():  # with autograd the blocks run as published (plain ops), as training runs them
        latent = model.encode_video(x.clone().requires_grad_())
        torch.testing.assert_close(latent.detach(), ref_latent, atol=ATOL, rtol=0)
        decoded = model.decode_video(ref_latent.clone().requires_grad_())
        torch.testing.assert_close(decoded.detach(), ref_decoded, atol=ATOL, rtol=0)

    plan = model.plan(case["input"]["t"])
    assert (plan.latent_frames, plan.decoded_frames) == (case["latent_shape"][1], case["decoded_shape"][1])

    if variant.get("is_h3"):  # H3's encoder drops the clip's last latents: no streaming
        with pytest.raises(NotImplementedError, match="cannot stream"):
            model.stream()
    if f"{case_name}/streamed" in expected:
        stream = model.stream()  # the published streaming API, frame by frame
        frames = []
        for t in range(x.shape[1]):
            latent = stream.encode(x[:, t : t + 1])
            frame = stream.decode(latent) if latent is not None else None
            while frame is not None:
                frames.append(frame)
                frame = stream.decode()
        frames += stream.flush()
        torch.testing.assert_close(torch.cat(frames, 1), expected[f"{case_name}/streamed"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("fixture_set", FIXTURE_SETS, ids=["original", "new_variants"])
def test_exports_have_the_published_keys_and_load_back_without_naming_the_variant(
    fixture_set, fixture_sets, loaded_models, tmp_path
):
    """What we save (.pth in the published key format, .safetensors with metadata) has
    exactly the published implementation's keys and shapes for every variant, so it loads
    there; and it loads back here by its published file name or by its metadata."""
    _, manifest, _ = fixture_sets[fixture_set]
    for name, variant in manifest["variants"].items():
        if variant["checkpoint_file_name"] is None:
            continue
        model = loaded_models(name)
        pth = save_weights(model, tmp_path / variant["checkpoint_file_name"])
        saved = torch.load(pth, weights_only=True)
        assert [[k, list(v.shape)] for k, v in saved.items()] == [list(item) for item in variant["state_dict"]], name
        assert TAEHV(pth).variant == name
        safetensors = save_weights(model, tmp_path / f"{name}_export.safetensors")
        assert TAEHV(safetensors).variant == name and read_metadata(safetensors)["variant"] == name
