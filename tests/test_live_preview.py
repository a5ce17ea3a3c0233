"""Live previews in real diffusers pipelines (one-layer transformers, the pipelines' own tiny
VAEs, published-format TAE weights): each step's preview is the TAE decoding the step's
denoised estimate in the TAE's own space, computed here from the latents the callback saw,
the scheduler's sigmas and the pipeline VAE's statistics."""

from __future__ import annotations

import pytest
import torch
from diffusers import (
    AutoencoderKLCogVideoX,
    AutoencoderKLHunyuanVideo,
    AutoencoderKLLTXVideo,
    AutoencoderKLWan,
)
from PIL import Image

from bench.lib.tiny_pipelines import PIPELINES, inputs
from conftest import TINY_VAES
from taehv_train.models.live_preview import LivePreview
from taehv_train.models.taehv import TAEHV

# float32 rounding of two routes to the same latents (x * std + mean against the pipeline's own
# order; the estimate's algebra in two orders), amplified by the recipe weights' large activations
# as in tests/test_diffusers_vae.py (ROUNDING): up to 6e-4 of the [0, 1] range seen; latents of
# another space decode more than 100 times farther (test_wan_pipeline_runs_end_to_end_with_the_tae)
TOLERANCE = 2e-3


def tiny_vae(name: str) -> torch.nn.Module:
    """The pipeline's own VAE, tiny, with its class's statistics (Wan 2.1's latents_mean/std,
    CogVideoX's and HunyuanVideo's scaling factors); LTX's made non-trivial (random
    latents_mean/std buffers, scaling factor 2) so that every conversion is one."""
    torch.manual_seed(0)
    if name == "wan":
        return AutoencoderKLWan(**TINY_VAES["wan"])
    if name == "cogvideox":
        return AutoencoderKLCogVideoX(**TINY_VAES["cogvideox"])
    if name == "hunyuan":
        return AutoencoderKLHunyuanVideo(**TINY_VAES["hunyuan"])
    vae = AutoencoderKLLTXVideo(**TINY_VAES["ltx"], scaling_factor=2.0)
    vae.latents_mean.copy_(torch.randn(128) * 0.1)
    vae.latents_std.copy_(torch.rand(128) + 0.5)
    return vae


def to_tae_space(name: str, variant: str, pipe, latents: torch.Tensor) -> torch.Tensor:
    """The callback's latents as NTCHW in ``variant``'s space, each conversion written out
    with the pipeline VAE's statistics (docs/reference_vaes.md, "Which latents go in")."""
    config = pipe.vae.config
    if name == "cogvideox":  # frames first, scaled; TAECVX: raw
        return latents / config.scaling_factor
    if name == "ltx":  # packed, normalised then scaled; TAELTX: normalised
        return pipe._unpack_latents(latents, 2, 2, 2, 1, 1).transpose(1, 2) / config.scaling_factor
    latents = latents.transpose(1, 2)
    if variant == "lighttaew2_1":  # Wan's normalised -> LightX2V's raw
        mean, std = (torch.tensor(config[key]).view(1, 1, 16, 1, 1) for key in ("latents_mean", "latents_std"))
        return latents * std + mean
    return latents  # Wan's normalised for TAEW2.1, HunyuanVideo's scaled for TAEHV


def run_with_preview(pipe, name: str, steps: int, preview: LivePreview) -> list[tuple]:
    """``pipe`` called for ``steps`` steps with ``preview`` as its callback; per step the
    latents the callback got, the scheduler's sigmas around the step and the preview."""
    seen = []

    def callback(pipe, step, timestep, kwargs):
        index = getattr(
            pipe.scheduler, "step_index", None
        )  # flow matching's: the step went sigmas[index - 1] -> [index]
        sigmas = None if index is None else pipe.scheduler.sigmas[index - 1 : index + 1].tolist()
        kwargs = preview(pipe, step, timestep, kwargs)
        seen.append((kwargs["latents"].clone(), sigmas, preview.latest))
        return kwargs

    pipe(
        **inputs(name),
        num_inference_steps=steps,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        callback_on_step_end=callback,
    )
    return seen


@torch.no_grad()
@pytest.mark.parametrize(
    "name,variant",
    [("wan", "taew2_1"), ("wan", "lighttaew2_1"), ("cogvideox", "taecvx"), ("hunyuan", "taehv"), ("ltx", "taeltx_2")],
)
def test_the_preview_is_the_tae_decoding_the_denoised_estimate_in_its_space(recipe_files, name, variant, tmp_path):
    """Three steps: the first has no latents before it (its preview: the latents as they are),
    each later one the flow-matching estimate x_i - sigma_i * v, v from two steps' latents
    (diffusers FlowMatchEulerDiscreteScheduler.step: x_{i+1} = x_i + (sigma_{i+1} - sigma_i) * v);
    CogVideoX's DDIM scheduler offers the callback no estimate: its previews are the latents."""
    pipe = PIPELINES[name](tiny_vae(name))
    preview = LivePreview.from_file(
        recipe_files(variant), pipe, out=tmp_path, video_size=(9, 64, 64) if name == "ltx" else None
    )
    seen = run_with_preview(pipe, name, 3, preview)
    tae = TAEHV(recipe_files(variant)).eval()
    flow = name != "cogvideox"
    for step, (latents, sigmas, shown) in enumerate(seen):
        estimate = latents
        if flow and step:  # written as (sigma_{i+1} x_i - sigma_i x_{i+1}) / (sigma_{i+1} - sigma_i), the same line
            (sigma, sigma_next), before = sigmas, seen[step - 1][0]
            estimate = (sigma_next * before - sigma * latents) / (sigma_next - sigma)
        expected = tae.decode_video(to_tae_space(name, variant, pipe, estimate[:1]))
        assert (shown.step, shown.denoised, shown.video.shape) == (step, flow and step > 0, expected.shape)
        torch.testing.assert_close(shown.video, expected, atol=TOLERANCE, rtol=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000.png", "step_0001.png", "step_0002.png"]
    strip = Image.open(tmp_path / "step_0001.png")
    assert strip.size == (8 * expected.shape[-1], expected.shape[-2])  # 8 of the 9 frames side by side


@torch.no_grad()
def test_the_estimate_is_the_schedulers_x0_from_the_transformers_prediction(recipe_files):
    """Three Wan steps: at each step after the first, the estimate taken from consecutive
    latents equals sample - sigma * model_output, the scheduler's own x0 (its stochastic
    branch), with the transformer's input and output caught by a hook (no guidance: the
    prediction is the output); after the last step (sigma 0) it is the final latents."""
    pipe = PIPELINES["wan"](tiny_vae("wan"))
    caught = []
    hook = pipe.transformer.register_forward_hook(
        lambda m, args, kw, out: caught.append((kw["hidden_states"], out[0])), with_kwargs=True
    )
    preview = LivePreview.from_file(recipe_files("taew2_1"), pipe)
    estimates = []
    original = preview.decode
    preview.decode = lambda latents: estimates.append(latents) or original(latents)
    seen = run_with_preview(pipe, "wan", 3, preview)
    hook.remove()
    for step in (1, 2):
        sample, prediction = caught[step]
        sigma = seen[step][1][0]
        torch.testing.assert_close(estimates[step], (sample - sigma * prediction).transpose(1, 2), atol=1e-5, rtol=0)
    torch.testing.assert_close(estimates[2], seen[2][0].transpose(1, 2), atol=1e-5, rtol=0)


@torch.no_grad()
def test_every_other_step_and_the_last_with_one_latent_frame(recipe_files):
    """every=2 previews steps 0, 2 and the last (3 of 4 steps: 0, 2, 3); latent_frames=1 decodes
    one latent frame, one video frame, as ComfyUI's previewer does."""
    pipe = PIPELINES["wan"](tiny_vae("wan"))
    preview = LivePreview.from_file(recipe_files("taew2_1"), pipe, every=2, latent_frames=1)
    shown = {p.step: p.video.shape for *_, p in run_with_preview(pipe, "wan", 4, preview)}
    assert shown == {0: (1, 1, 3, 32, 32), 2: (1, 1, 3, 32, 32), 3: (1, 1, 3, 32, 32)}


def test_settings_that_cannot_preview_are_refused(recipe_files):
    wan = PIPELINES["wan"](tiny_vae("wan"))
    with pytest.raises(ValueError, match="every must be 1 or more"):
        LivePreview.from_file(recipe_files("taew2_1"), wan, every=0)
    ltx = PIPELINES["ltx"](tiny_vae("ltx"))
    with pytest.raises(ValueError, match=r"LTXPipeline packs its latents into tokens: pass video_size="):
        LivePreview.from_file(recipe_files("taeltx_2"), ltx)


@torch.no_grad()
def test_the_benchmark_reports_the_preview_against_the_step_and_the_bf16_estimate():
    """bench/bench_preview.py on its smallest run: the ratio is of the figures it prints, and
    with the transformer in bf16 the estimate is nearer the scheduler's x0 than the latents
    are before the last step, and equal to them after it (sigma 0)."""
    from bench.bench_preview import main

    report = main(["--steps", "2", "--repeats", "1", "--bf16_steps", "6", "--latent_frames", "1"])
    assert report["preview_shape"] == [1, 1, 3, 32, 32]
    assert report["preview_per_step"] == pytest.approx(report["preview_seconds"] / report["step_seconds"], rel=1e-2)
    rows = report["bf16_estimate_error"]
    assert [row["step"] for row in rows] == [1, 2, 4, 5]
    assert all(row["estimate"] < row["latents"] for row in rows[:-1])
    assert rows[-1]["estimate"] == rows[-1]["latents"]
