"""The preview score: the first latent decoded alone (what ComfyUI's live preview shows),
against the published TAEHV, in inference.py's metrics.json and report, and in validation."""

from __future__ import annotations

import importlib.util
import json
import math
import re

import pytest
import torch
from test_inference import CLIPS, assert_fits_the_window_in_its_aspect, render, run_inference, weights  # noqa: F401 (fixtures)

from conftest import shared_dir
from taehv_train.common.metrics import video_psnr
from taehv_train.common.preview_score import preview_decode, preview_scores
from taehv_train.models.taehv import TAEHV
from taehv_train.models.weights import save_weights


def published_taehv():
    """The published ``taehv.py`` (../shared/reference), imported from where it lies."""
    spec = importlib.util.spec_from_file_location("taehv_published", shared_dir() / "reference" / "taehv_published.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_clip(model: TAEHV, frames: int = 17) -> torch.Tensor:
    side = 8 * model.patch_size
    return torch.rand(1, frames, 3, side, side, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "variant, frames", [("taehv", 1), ("taecvx", 1), ("taeh3", 1), ("taeltx2_3", 1), ("tae_allegro", 4)]
)
@torch.no_grad()
def test_one_latent_decodes_to_the_frames_the_frame_rule_gives(variant, frames):
    """A causal TAE trims the t_upscale - 1 frames before the first (taecvx too: one latent
    is an odd count; H3 per chunk); a non-causal one keeps all t_upscale."""
    torch.manual_seed(0)
    model = TAEHV(variant=variant).eval()
    latents = model.encode_video(random_clip(model, 2 * model.t_downscale + 1))
    assert model.first_latent_frames() == frames
    assert preview_decode(model, latents).shape[1] == frames


@pytest.mark.parametrize("variant", ["taecvx", "taeh3", "taeltx2_3"])
@torch.no_grad()
def test_the_preview_is_the_published_taehv_decoding_the_first_latent_alone(variant, tmp_path):
    """As ComfyUI's previewer decodes ``x0[:1, :, :1]``: the published TAEHV decoding the first
    latent on its own gives the same frame. A causal decoder's first frame depends on the first
    latent only, so it is also the whole clip's first decoded frame, and not its second."""
    torch.manual_seed(0)
    model = TAEHV(variant=variant).eval()
    published = published_taehv().TAEHV(str(save_weights(model, tmp_path / f"{variant}.pth"))).eval()
    frames = random_clip(model)
    latents = model.encode_video(frames)
    preview = preview_decode(model, latents)
    directly = published.decode_video(latents[:, :1], parallel=True, show_progress_bar=False)
    # the published H3 decoder fills a chunk's missing latents' frames with black ones after it
    torch.testing.assert_close(preview, directly[:, : preview.shape[1]], atol=1e-4, rtol=0)
    whole = model.decode_video(latents)
    torch.testing.assert_close(preview, whole[:, :1], atol=1e-5, rtol=0)
    assert (preview - whole[:, 1:2]).abs().max() > 1e-3
    scores = preview_scores(preview, frames)
    assert float(scores["psnr"][0]) == pytest.approx(float(video_psnr(whole[:, :1], frames[:, :1])[0]), abs=1e-3)
    assert float(scores["psnr"][0]) != pytest.approx(float(video_psnr(whole, frames[:, : whole.shape[1]])[0]), abs=1e-3)


@pytest.mark.slow  # inference.py with the reference VAE, and the report in Chromium
def test_inference_reports_the_preview_score_beside_the_whole_clip(
    weights,  # noqa: F811
    tiny_cogvideox_vae,
    videos_dir,
    tmp_path,
    run_inference,  # noqa: F811
):
    out = tmp_path / "results"
    result = run_inference(
        *("--model_path", str(weights), "--videos", str(videos_dir / CLIPS[0]), "--n_frames", "9"),
        *("--height", "64", "--width", "96", "--use_ref_vae", "--ref_vae_path", str(tiny_cogvideox_vae)),
        *("--output_dir", str(out)),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Preview score (the first latent decoded alone" in result.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    sample = metrics["samples"][0]
    preview = sample["preview"]
    assert preview["frames"] == [0]  # taecvx: the first latent alone stands for the first input frame
    keys = ("psnr", "ssim", "psnr_from_reference_latents", "ssim_from_reference_latents")
    keys += ("psnr_vs_reference_decode", "ssim_vs_reference_decode")
    assert all(math.isfinite(preview[key]) for key in keys), preview
    # the whole clip's first frame, scored by the whole-clip path, is the same frame (a causal decoder)
    assert preview["psnr"] == pytest.approx(sample["taehv"]["psnr_per_frame"][0], abs=2e-3)
    assert preview["psnr"] != pytest.approx(sample["taehv"]["psnr"], abs=1e-2)
    assert preview["psnr_vs_reference_decode"] != pytest.approx(preview["psnr_from_reference_latents"], abs=1e-2)
    assert metrics["summary"]["preview"]["psnr"]["mean"] == preview["psnr"]

    dom, image = render(out / "summary_report.html", tmp_path, 900)
    section = dom[dom.index("<h2>Preview score</h2>") : dom.index("<h2>PSNR per frame</h2>")]
    assert "the first latent decoded alone against input frame 0" in section
    assert f"{preview['psnr']:.4g}" in section and f"{preview['psnr_vs_reference_decode']:.4g}" in section
    assert re.search(r"<th>preview PSNR dB</th>", dom)
    assert_fits_the_window_in_its_aspect(dom, 1)
    assert image is not None and image.std() > 10
