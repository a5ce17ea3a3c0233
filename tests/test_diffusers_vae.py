"""A TAE as ``pipe.vae`` in real diffusers video pipelines, built tiny on CPU (no text
encoder: prompt embeddings are given): the pipelines' own latent-decoding paths with the
wrapper in place give what calling the TAE directly gives."""
from __future__ import annotations

import pytest
import torch
from diffusers import (AutoencoderKLLTXVideo, CogVideoXDDIMScheduler, CogVideoXPipeline, FlowMatchEulerDiscreteScheduler,
                       HunyuanVideoPipeline, HunyuanVideoTransformer3DModel, LTXPipeline, LTXVideoTransformer3DModel,
                       WanPipeline, WanTransformer3DModel)

from conftest import save_tiny_vae
from models.diffusers_vae import TAEVideoVAE
from models.taehv import TAEHV
from models.weights import save_weights


def wrapped(variant: str, tmp_path, like: torch.nn.Module | None = None) -> TAEVideoVAE:
    torch.manual_seed(0)
    return TAEVideoVAE.from_file(save_weights(TAEHV(variant=variant), tmp_path / f"{variant}.pth"), like=like)


def one_step(pipe, **inputs):
    """``pipe`` called for one denoising step, returning what ``output_type`` asks for."""
    def run(output_type: str) -> torch.Tensor:
        return pipe(**inputs, num_inference_steps=1, guidance_scale=1.0, output_type=output_type,
                    generator=torch.Generator().manual_seed(0)).frames
    return run


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
    run = one_step(pipe, prompt_embeds=torch.randn(1, 4, 16), height=32, width=32, num_frames=9)
    latents = run("latent")
    assert latents.shape == (1, 16, 3, 4, 4)
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    direct = vae.tae.decode_video((latents * std + mean).permute(0, 2, 1, 3, 4))
    torch.testing.assert_close(run("pt"), direct, atol=1e-5, rtol=0)


@torch.no_grad()
def test_hunyuan_video_pipeline_runs_end_to_end_with_the_tae(tmp_path):
    """A whole (one-step) HunyuanVideoPipeline call: the TAE decodes the denoised latents
    once the pipeline has divided them by HunyuanVideo's scaling factor."""
    vae = wrapped("taehv", tmp_path)
    transformer = HunyuanVideoTransformer3DModel(num_attention_heads=2, attention_head_dim=8, num_layers=1,
                                                 num_single_layers=1, num_refiner_layers=1, text_embed_dim=16,
                                                 pooled_projection_dim=8, rope_axes_dim=(2, 2, 4))
    pipe = HunyuanVideoPipeline(text_encoder=None, tokenizer=None, transformer=transformer, vae=vae,
                                scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=None, tokenizer_2=None)
    assert vae.config.scaling_factor == 0.476986  # HunyuanVideo's, from its class defaults
    run = one_step(pipe, prompt_embeds=torch.randn(1, 4, 16), pooled_prompt_embeds=torch.randn(1, 8),
                   prompt_attention_mask=torch.ones(1, 4), height=32, width=32, num_frames=9)
    latents = run("latent")
    assert latents.shape == (1, 16, 3, 4, 4)
    direct = vae.tae.decode_video((latents / vae.config.scaling_factor).permute(0, 2, 1, 3, 4))
    torch.testing.assert_close(run("pt"), direct, atol=1e-5, rtol=0)


@torch.no_grad()
def test_ltx_pipeline_runs_end_to_end_with_the_tae_and_the_vaes_statistics(tmp_path):
    """A whole (one-step) LTXPipeline call with ``like=`` a real (tiny) LTX VAE whose
    latents_mean/std buffers are not trivial: the pipeline un-normalises with them (read
    from the wrapper), and the TAE decodes the result."""
    real = AutoencoderKLLTXVideo.from_pretrained(save_tiny_vae(tmp_path, "ltx") / "vae")
    real.latents_mean.copy_(torch.randn(128) * 0.1)
    real.latents_std.copy_(torch.rand(128) + 0.5)
    vae = wrapped("taeltx_2", tmp_path, like=real)
    transformer = LTXVideoTransformer3DModel(in_channels=128, out_channels=128, num_attention_heads=2,
                                             attention_head_dim=8, cross_attention_dim=16, num_layers=1,
                                             caption_channels=16)
    pipe = LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                       transformer=transformer)
    run = one_step(pipe, prompt_embeds=torch.randn(1, 4, 16), prompt_attention_mask=torch.ones(1, 4), height=64,
                   width=64, num_frames=9)
    packed = run("latent")  # LTX returns its normalised latents packed into tokens
    latents = pipe._unpack_latents(packed, 2, 2, 2, pipe.transformer_spatial_patch_size,
                                   pipe.transformer_temporal_patch_size)
    latents = latents * real.latents_std.view(1, -1, 1, 1, 1) / real.config.scaling_factor + \
        real.latents_mean.view(1, -1, 1, 1, 1)
    direct = vae.tae.decode_video(latents.permute(0, 2, 1, 3, 4))
    assert direct.shape == (1, 9, 3, 64, 64)
    torch.testing.assert_close(run("pt"), direct, atol=1e-5, rtol=0)


def test_reference_vaes_whose_statistics_live_in_their_weights_need_the_pipelines_vae(tmp_path):
    """LTX's latents_mean/std are buffers of its VAE, Wan 2.2's 48 values are not the class
    defaults: without ``like=pipe.vae`` the wrapper says so instead of using wrong ones."""
    for variant, message in (("taeltx2_3", "pass like=<the pipeline's VAE>"), ("taew2_2", "has 16 channels")):
        with pytest.raises(ValueError, match=message):
            wrapped(variant, tmp_path)


def test_a_like_vae_of_another_latent_space_is_refused(tmp_path):
    """like= a Wan VAE with 4 latent channels for a 16-channel TAE: refused with both numbers,
    never a config whose z_dim is quietly rewritten."""
    import diffusers

    like = diffusers.AutoencoderKLWan(base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    with pytest.raises(ValueError, match="like= is a VAE with 4 latent channels, but taew2_1 has 16"):
        wrapped("taew2_1", tmp_path, like=like)
