"""A TAE as ``pipe.vae`` in real diffusers video pipelines, built tiny on CPU (no text
encoder: prompt embeddings are given): the pipelines' own latent-decoding paths with the
wrapper in place give what calling the TAE directly gives."""
from __future__ import annotations

import pytest
import torch
from diffusers import (CogVideoXDDIMScheduler, CogVideoXPipeline, FlowMatchEulerDiscreteScheduler, WanPipeline,
                       WanTransformer3DModel)

from models.checkpoint import save_weights
from models.diffusers_vae import TAEVideoVAE
from models.taehv import TAEHV


def wrapped(variant: str, tmp_path) -> TAEVideoVAE:
    torch.manual_seed(0)
    return TAEVideoVAE.from_file(save_weights(TAEHV(variant=variant), tmp_path / f"{variant}.pth"))


@torch.no_grad()
def test_cogvideox_pipeline_decodes_through_the_tae(tmp_path):
    vae = wrapped("taecvx", tmp_path)
    pipe = CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=None,
                             scheduler=CogVideoXDDIMScheduler())
    assert (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal) == (8, 4)
    assert pipe.vae_scaling_factor_image == 1.15258426  # CogVideoX's, applied by the pipeline, not by the TAE
    latents = torch.randn(1, 5, 16, 4, 6)  # the pipeline's scaled latents, NTCHW
    video = pipe.decode_latents(latents)
    direct = vae.tae.decode_video(latents / pipe.vae_scaling_factor_image).mul(2).sub(1).permute(0, 2, 1, 3, 4)
    torch.testing.assert_close(video, direct, atol=1e-6, rtol=0)
    encoded = vae.encode(video.clamp(-1, 1))
    assert encoded.latents.shape == (1, 16, 5, 4, 6) and torch.equal(encoded.latent_dist.sample(), encoded.latents)
    vae.enable_tiling(), vae.enable_slicing()  # accepted, nothing to do
    assert (vae.dtype, vae.device.type) == (torch.float32, "cpu")


@torch.no_grad()
def test_wan_pipeline_runs_end_to_end_with_the_tae(tmp_path):
    """A whole (one-step) WanPipeline call: the video it returns is the TAE's decoding of the
    latents it denoised, un-normalised with Wan's latents_mean/std as the pipeline does."""
    vae = wrapped("taew2_1", tmp_path)
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                        in_channels=16, out_channels=16, text_dim=16, freq_dim=16, ffn_dim=16,
                                        num_layers=1, rope_max_seq_len=32)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    embeds = torch.randn(1, 4, 16)

    def run(output_type: str) -> torch.Tensor:
        return pipe(prompt_embeds=embeds, height=32, width=32, num_frames=9, num_inference_steps=1, guidance_scale=1.0,
                    output_type=output_type, generator=torch.Generator().manual_seed(0)).frames

    latents = run("latent")
    assert latents.shape == (1, 16, 3, 4, 4)
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    direct = vae.tae.decode_video((latents * std + mean).permute(0, 2, 1, 3, 4))
    torch.testing.assert_close(run("pt"), direct, atol=1e-5, rtol=0)


def test_teachers_whose_statistics_live_in_their_weights_need_the_pipelines_vae(tmp_path):
    """LTX's latents_mean/std are buffers of its VAE, Wan 2.2's 48 values are not the class
    defaults: without ``like=pipe.vae`` the wrapper says so instead of using wrong ones."""
    for variant, message in (("taeltx2_3", "pass like=<the pipeline's VAE>"), ("taew2_2", "has 16 channels")):
        with pytest.raises(ValueError, match=message):
            wrapped(variant, tmp_path)
