"""A TAE as ``pipe.vae`` in real diffusers video pipelines, built tiny on CPU (no text
encoder: prompt embeddings are given): the pipelines' own latent-decoding paths with the
wrapper in place give what the published convention gives: the TAE decoding the latents in
its own space (``models.latent_spaces``). For every TAE but TAECVX and LightX2V's, that is
the transformer's latents as they are (``output_type="latent"``), which is what the TAE
author's own wrappers hand it (latents_mean 0, latents_std 1, scaling_factor 1:
madebyollin/taehv examples/TAEW2.1_T2I_Demo.ipynb)."""

from __future__ import annotations

import pytest
import torch
from diffusers import (
    AllegroPipeline,
    AllegroTransformer3DModel,
    AutoencoderKLLTXVideo,
    CogVideoXDDIMScheduler,
    CogVideoXPipeline,
    CosmosTextToWorldPipeline,
    CosmosTransformer3DModel,
    CosmosVideoToWorldPipeline,
    DDIMScheduler,
    EasyAnimatePipeline,
    EasyAnimateTransformer3DModel,
    EDMEulerScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    HunyuanImageRefinerPipeline,
    HunyuanImageTransformer2DModel,
    MochiPipeline,
    MochiTransformer3DModel,
    QwenImage21Pipeline,
    QwenImage21Transformer2DModel,
    StableVideoDiffusionPipeline,
    UNetSpatioTemporalConditionModel,
)
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

from bench.lib.tiny_pipelines import hunyuan_pipeline, ltx_pipeline, wan_pipeline
from conftest import save_tiny_vae
from taehv_train.models.diffusers_vae import TAEVideoVAE
from taehv_train.models.latent_spaces import LatentTransform
from taehv_train.models.taehv import TAEHV
from taehv_train.models.unloaded_references import published_transform
from taehv_train.models.weights import save_weights

# float32 rounding of the pipelines' own arithmetic (x / (1 / std) against x * std, ...), amplified by
# the recipe weights' large activations: up to 5e-4 of the [-1, 1] range seen; a TAE handed the
# latents of another space differs by far more (test_wan_pipeline_runs_end_to_end_with_the_tae)
ROUNDING = 2e-3


def wrapped(variant: str, recipe_files, like: torch.nn.Module | None = None) -> TAEVideoVAE:
    """Published-format weights behind the wrapper."""
    return TAEVideoVAE.from_file(recipe_files(variant), like=like)


def one_step(pipe, **inputs):
    """``pipe`` called for one denoising step (unless ``inputs`` ask for more), returning what
    ``output_type`` asks for."""

    def run(output_type: str) -> torch.Tensor:
        return pipe(
            **{"num_inference_steps": 1, "guidance_scale": 1.0, **inputs},
            output_type=output_type,
            generator=torch.Generator().manual_seed(0),
        ).frames

    return run


@torch.no_grad()
def test_cogvideox_pipeline_decodes_through_the_tae(recipe_files):
    vae = wrapped("taecvx", recipe_files)
    pipe = CogVideoXPipeline(
        tokenizer=None, text_encoder=None, vae=vae, transformer=None, scheduler=CogVideoXDDIMScheduler()
    )
    assert (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal) == (8, 4)
    assert pipe.vae_scaling_factor_image == 1.15258426  # CogVideoX's, applied by the pipeline, not by the TAE
    latents = torch.randn(1, 5, 16, 4, 6)  # the pipeline's scaled latents, NTCHW
    video = pipe.decode_latents(latents)
    direct = vae.tae.decode_video(1 / pipe.vae_scaling_factor_image * latents).mul(2).sub(1).permute(0, 2, 1, 3, 4)
    torch.testing.assert_close(video, direct, atol=1e-6, rtol=0)
    encoded = vae.encode(video.clamp(-1, 1))
    assert encoded.latents.shape == (1, 16, 5, 4, 6) and torch.equal(encoded.latent_dist.sample(), encoded.latents)
    vae.enable_tiling(), vae.enable_slicing()  # accepted, nothing to do
    assert (vae.dtype, vae.device.type) == (torch.float32, "cpu")


@torch.no_grad()
def test_wan_pipeline_runs_end_to_end_with_the_tae(recipe_files):
    """A whole (one-step) WanPipeline call: the pipeline un-normalises the latents it denoised
    with Wan's latents_mean/std, the wrapper normalises them back, and the video it returns is
    TAEW2.1's decoding of the transformer's latents, as the author's wrapper gives it."""
    vae = wrapped("taew2_1", recipe_files)
    pipe = wan_pipeline(vae)
    run = one_step(pipe, prompt_embeds=torch.randn(1, 4, 16), height=32, width=32, num_frames=9)
    latents = run("latent")
    assert latents.shape == (1, 16, 3, 4, 4)
    direct = vae.tae.decode_video(latents.permute(0, 2, 1, 3, 4))  # the author's wrapper: normalised latents
    torch.testing.assert_close(run("pt"), direct, atol=ROUNDING, rtol=0)
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    raw = vae.tae.decode_video((latents * std + mean).permute(0, 2, 1, 3, 4))  # what a raw-latent TAE gets
    assert (raw - direct).abs().max() > 100 * ROUNDING


@torch.no_grad()
def test_wan_pipeline_hands_lighttae_the_raw_latents_as_lightx2v_does(recipe_files):
    """LightX2V's lighttaew2_1 works on raw Wan latents: its runner computes latents *
    latents_std + latents_mean before decoding (need_scaled), which is what the pipeline
    hands ``vae.decode``; the wrapper passes them through."""
    vae = wrapped("lighttaew2_1", recipe_files)
    assert vae.transform.space == "raw"
    run = one_step(wan_pipeline(vae), prompt_embeds=torch.randn(1, 4, 16), height=32, width=32, num_frames=9)
    latents = run("latent")
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    direct = vae.tae.decode_video((latents * std + mean).permute(0, 2, 1, 3, 4))
    torch.testing.assert_close(run("pt"), direct, atol=ROUNDING, rtol=0)


@torch.no_grad()
def test_hunyuan_video_pipeline_runs_end_to_end_with_the_tae(recipe_files):
    """A whole (one-step) HunyuanVideoPipeline call: the pipeline divides the denoised latents
    by HunyuanVideo's scaling factor, the wrapper multiplies them back, and TAEHV decodes the
    transformer's scaled latents, as ComfyUI's HunyuanVideo latent format hands them to it."""
    vae = wrapped("taehv", recipe_files)
    pipe = hunyuan_pipeline(vae)
    assert vae.config.scaling_factor == 0.476986  # HunyuanVideo's, from its class defaults
    run = one_step(
        pipe,
        prompt_embeds=torch.randn(1, 4, 16),
        pooled_prompt_embeds=torch.randn(1, 8),
        prompt_attention_mask=torch.ones(1, 4),
        height=32,
        width=32,
        num_frames=9,
    )
    latents = run("latent")
    assert latents.shape == (1, 16, 3, 4, 4)
    direct = vae.tae.decode_video(latents.permute(0, 2, 1, 3, 4))
    torch.testing.assert_close(run("pt"), direct, atol=ROUNDING, rtol=0)


@torch.no_grad()
def test_ltx_pipeline_runs_end_to_end_with_the_tae_and_the_vaes_statistics(tmp_path, recipe_files):
    """A whole (one-step) LTXPipeline call with ``like=`` a real (tiny) LTX VAE whose
    latents_mean/std buffers are not trivial: the pipeline un-normalises with them (read
    from the wrapper), the wrapper normalises them back, and the TAE decodes
    (raw - latents_mean) / latents_std, as the author's TAELTX2 demo hands it latents."""
    real = AutoencoderKLLTXVideo.from_pretrained(save_tiny_vae(tmp_path, "ltx") / "vae")
    real.latents_mean.copy_(torch.randn(128) * 0.1)
    real.latents_std.copy_(torch.rand(128) + 0.5)
    vae = wrapped("taeltx_2", recipe_files, like=real)
    pipe = ltx_pipeline(vae)
    run = one_step(
        pipe,
        prompt_embeds=torch.randn(1, 4, 16),
        prompt_attention_mask=torch.ones(1, 4),
        height=64,
        width=64,
        num_frames=9,
    )
    packed = run("latent")  # LTX returns its normalised latents packed into tokens
    latents = pipe._unpack_latents(
        packed, 2, 2, 2, pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
    )
    normalised = latents / real.config.scaling_factor  # the transformer's are scaled too (1.0 in LTX's configs)
    direct = vae.tae.decode_video(normalised.permute(0, 2, 1, 3, 4))
    assert direct.shape == (1, 9, 3, 64, 64)
    torch.testing.assert_close(run("pt"), direct, atol=ROUNDING, rtol=0)


@torch.no_grad()
def test_mochi_pipeline_runs_end_to_end_with_the_built_tae(recipe_files):
    """A whole MochiPipeline call with tae_mochi: the pipeline un-normalises with Mochi's
    per-channel latents_mean/std (the class defaults), and the TAE decodes the transformer's
    latents, 6k+1 frames. Two steps: Mochi's linear-quadratic schedule divides by zero for one."""
    vae = wrapped("tae_mochi", recipe_files)
    transformer = MochiTransformer3DModel(
        patch_size=2,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        pooled_projection_dim=16,
        in_channels=12,
        text_embed_dim=16,
        time_embed_dim=4,
        max_sequence_length=16,
    )
    pipe = MochiPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None, transformer=transformer
    )
    run = one_step(
        pipe,
        prompt_embeds=torch.randn(1, 4, 16),
        prompt_attention_mask=torch.ones(1, 4),
        height=32,
        width=32,
        num_frames=7,
        num_inference_steps=2,
    )
    latents = run("latent")
    assert latents.shape == (1, 12, 2, 4, 4)
    direct = vae.tae.decode_video(latents.permute(0, 2, 1, 3, 4))
    assert direct.shape == (1, 7, 3, 32, 32)
    torch.testing.assert_close(run("pt"), direct, atol=ROUNDING, rtol=0)


@torch.no_grad()
def test_easyanimate_pipeline_runs_end_to_end_with_the_built_tae(recipe_files):
    """A whole EasyAnimatePipeline call with tae_easyanimate: the TAE decodes the transformer's
    latents, which the pipeline divides by EasyAnimate's scaling factor before ``vae.decode``
    (head dim 16: its rotary embedding splits the head into 1/4 + 3/8 + 3/8, each even)."""
    vae = wrapped("tae_easyanimate", recipe_files)
    transformer = EasyAnimateTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=16,
        out_channels=16,
        time_embed_dim=8,
        text_embed_dim=16,
        num_layers=1,
        mmdit_layers=1,
        sample_width=4,
        sample_height=4,
        patch_size=2,
    )
    pipe = EasyAnimatePipeline(
        vae=vae, text_encoder=None, tokenizer=None, transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler()
    )
    assert vae.config.scaling_factor == 0.7125  # EasyAnimate's (AutoencoderKLMagvit's default)
    run = one_step(
        pipe,
        prompt_embeds=torch.randn(1, 4, 16),
        prompt_attention_mask=torch.ones(1, 4),
        height=32,
        width=32,
        num_frames=5,
    )
    latents = run("latent")
    assert latents.shape == (1, 16, 2, 4, 4)
    direct = vae.tae.decode_video(latents.permute(0, 2, 1, 3, 4))
    assert direct.shape == (1, 5, 3, 32, 32)
    torch.testing.assert_close(run("pt"), direct, atol=ROUNDING, rtol=0)


@torch.no_grad()
def test_allegro_pipeline_runs_end_to_end_with_the_built_tae(recipe_files):
    """A whole AllegroPipeline call with tae_allegro (not causal: 4 frames per latent). The
    real Allegro VAE's decode returns NTCHW, which the pipeline permutes to NCTHW, so the
    wrapper's does too; its spatial factor comes from the class's block_out_channels."""
    vae = wrapped("tae_allegro", recipe_files)
    transformer = AllegroTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        cross_attention_dim=24,
        sample_width=4,
        sample_height=4,
        sample_frames=8,
        caption_channels=16,
    )
    pipe = AllegroPipeline(
        tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=DDIMScheduler()
    )
    assert (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal) == (8, 4)
    run = one_step(
        pipe,
        prompt_embeds=torch.randn(1, 4, 16),
        prompt_attention_mask=torch.ones(1, 4),
        height=32,
        width=32,
        num_frames=8,
    )
    latents = run("latent")
    assert latents.shape == (1, 4, 2, 4, 4)
    assert vae.decode(latents).sample.shape == (1, 8, 3, 32, 32)  # frames first, as AutoencoderKLAllegro's
    direct = vae.tae.decode_video(latents.permute(0, 2, 1, 3, 4))
    assert direct.shape == (1, 8, 3, 32, 32)
    torch.testing.assert_close(run("pt"), direct, atol=ROUNDING, rtol=0)


class PassingGuardrail:
    """Stands in for Cosmos's safety checker, without which its pipelines do not run (None is
    refused; cosmos_guardrail, not installed here, loads NVIDIA's guard models from the Hub):
    lets every prompt and video through unchanged."""

    def to(self, device):
        return self

    def check_text_safety(self, prompt: str) -> bool:
        return True

    def check_video_safety(self, frames):
        return frames


def cosmos_parts(in_channels: int) -> dict:
    """A tiny Cosmos transformer (it does not concatenate the padding mask, which needs
    torchvision, not installed: the VAE path is the same; heads 16 wide, as its rotary
    embedding needs more than 2 dimensions per axis), its EDM scheduler and the guardrail."""
    transformer = CosmosTransformer3DModel(
        in_channels=in_channels,
        out_channels=16,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=1,
        mlp_ratio=2,
        text_embed_dim=16,
        adaln_lora_dim=4,
        max_size=(4, 32, 32),
        concat_padding_mask=False,
    )
    scheduler = EDMEulerScheduler(
        sigma_min=0.002,
        sigma_max=80,
        sigma_data=0.5,
        sigma_schedule="karras",
        prediction_type="epsilon",
        rho=7.0,
        final_sigmas_type="sigma_min",
    )
    return dict(
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
        scheduler=scheduler,
        safety_checker=PassingGuardrail(),
    )


def cosmos_statistics(vae: TAEVideoVAE, latent_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosmos's latents_mean/std for the first latent frames, as its pipelines view them (one
    per channel and latent frame)."""
    mean, std = (
        torch.tensor(stats).view(1, 16, -1, 1, 1)[:, :, :latent_frames]
        for stats in (vae.config.latents_mean, vae.config.latents_std)
    )
    return mean, std


@torch.no_grad()
def test_cosmos_text_to_world_pipeline_runs_end_to_end_with_the_built_tae(recipe_files):
    """A whole CosmosTextToWorldPipeline call with tae_cosmos: the pipeline un-normalises with
    Cosmos's latents_mean/std, one per channel and latent frame, and the scheduler's
    sigma_data, and the TAE decodes the transformer's latents. The video then passes the
    safety checker as uint8 frames, hence the 1/255 tolerance."""
    vae = wrapped("tae_cosmos", recipe_files)
    pipe = CosmosTextToWorldPipeline(vae=vae, **cosmos_parts(in_channels=16))
    run = one_step(pipe, prompt_embeds=torch.randn(1, 4, 16), height=32, width=32, num_frames=9)
    latents = run("latent")
    assert latents.shape == (1, 16, 2, 4, 4)
    mean, _ = cosmos_statistics(vae, 2)
    assert not torch.equal(mean[:, :, 0], mean[:, :, 1])  # per latent frame
    direct = vae.tae.decode_video(latents.permute(0, 2, 1, 3, 4))
    assert direct.shape == (1, 9, 3, 32, 32)
    torch.testing.assert_close(run("pt"), direct, atol=1 / 255 + ROUNDING, rtol=0)


@torch.no_grad()
def test_cosmos_video_to_world_pipeline_encodes_and_decodes_with_the_built_tae(recipe_files):
    """CosmosVideoToWorldPipeline encodes its conditioning image with ``vae.encode`` (padded
    with grey frames to the clip) and normalises it per channel and latent frame: its
    conditioning latents are the TAE's own (the transformer's space), and a whole call
    decodes through the TAE as text-to-world does."""
    vae = wrapped("tae_cosmos", recipe_files)
    pipe = CosmosVideoToWorldPipeline(vae=vae, **cosmos_parts(in_channels=17))  # + the conditioning mask
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    _, conditioning, *_ = pipe.prepare_latents(
        image[:, :, None] * 2 - 1, 1, 16, 32, 32, 9, False, dtype=torch.float32, device=torch.device("cpu")
    )
    clip = torch.cat([image[:, None], torch.full((1, 8, 3, 32, 32), 0.5)], 1)  # grey: 0 in [-1, 1]
    torch.testing.assert_close(conditioning, vae.tae.encode_video(clip).permute(0, 2, 1, 3, 4), atol=ROUNDING, rtol=0)
    run = one_step(pipe, image=image, prompt_embeds=torch.randn(1, 4, 16), height=32, width=32, num_frames=9)
    latents = run("latent")
    assert latents.shape == (1, 16, 2, 4, 4)
    direct = vae.tae.decode_video(latents.permute(0, 2, 1, 3, 4))
    torch.testing.assert_close(run("pt"), direct, atol=1 / 255 + ROUNDING, rtol=0)


@torch.no_grad()
def test_stable_video_diffusion_pipeline_runs_end_to_end_with_the_built_tae(recipe_files):
    """A whole StableVideoDiffusionPipeline call with tae_svd: the pipeline encodes its
    conditioning image (B, 3, H, W) with ``vae.encode`` and decodes (B*T, 4, h, w) frame
    latents in chunks of ``decode_chunk_size`` with ``num_frames=chunk``; the wrapper decodes
    each chunk as one clip, as the real temporal decoder does, from the UNet's scaled latents.
    Its conditioning image latents are raw (SVD's pipeline does not scale them)."""
    vae = wrapped("tae_svd", recipe_files)
    unet = UNetSpatioTemporalConditionModel(
        block_out_channels=(32,),
        layers_per_block=1,
        in_channels=8,
        out_channels=4,
        down_block_types=("CrossAttnDownBlockSpatioTemporal",),
        up_block_types=("CrossAttnUpBlockSpatioTemporal",),
        cross_attention_dim=16,
        num_attention_heads=2,
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=24,
        num_frames=4,
    )
    image_encoder = CLIPVisionModelWithProjection(
        CLIPVisionConfig(
            hidden_size=16,
            projection_dim=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=16,
            image_size=32,
            patch_size=8,
        )
    )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="v_prediction",
        sigma_max=700.0,
        sigma_min=0.002,
        steps_offset=1,
        timestep_spacing="leading",
        timestep_type="continuous",
        use_karras_sigmas=True,
    )
    pipe = StableVideoDiffusionPipeline(
        vae=vae,
        image_encoder=image_encoder,
        unet=unet,
        scheduler=scheduler,
        feature_extractor=CLIPImageProcessor(crop_size=32, size=32),
    )
    assert pipe.vae_scale_factor == 8  # 2 ** (len(block_out_channels) - 1): SVD's class default has one block
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    encoded = vae.encode(images * 2 - 1).latent_dist.mode()  # as the pipeline's _encode_vae_image
    assert encoded.shape == (2, 4, 4, 4)
    own = vae.tae.encode_video(images[:, None])[:, 0]  # 1-frame clips, in the TAE's (scaled) space
    torch.testing.assert_close(encoded, own / vae.config.scaling_factor, atol=1e-6, rtol=0)

    def run(output_type: str) -> torch.Tensor:  # max_guidance_scale=1: no classifier-free guidance
        return pipe(
            images[:1],
            height=32,
            width=32,
            num_frames=4,
            decode_chunk_size=2,
            num_inference_steps=1,
            max_guidance_scale=1.0,
            output_type=output_type,
            generator=torch.Generator().manual_seed(0),
        ).frames

    latents = run("latent")
    assert latents.shape == (1, 4, 4, 4, 4)  # NTCHW
    direct = torch.cat([vae.tae.decode_video(latents[:, :2]), vae.tae.decode_video(latents[:, 2:])], 1)
    assert direct.shape == (1, 4, 3, 32, 32)
    torch.testing.assert_close(run("pt"), direct, atol=ROUNDING, rtol=0)
    raw = latents / vae.config.scaling_factor  # what the pipeline hands vae.decode
    frames = vae.decode(raw.flatten(0, 1), num_frames=2).sample  # both chunks in one call: 2 latents per clip
    torch.testing.assert_close(frames, direct.flatten(0, 1).mul(2).sub(1), atol=ROUNDING, rtol=0)


@torch.no_grad()
def test_hunyuanimage_refiner_pipeline_runs_end_to_end_with_the_built_tae(recipe_files):
    """A whole HunyuanImageRefinerPipeline call with tae_hunyuanimage_refiner: the pipeline
    encodes the image to refine as a one-frame clip, packs the latents of two frames (the
    first repeated) into 64 channels for its transformer, unpacks them and decodes one frame
    of 32-channel latents: the TAE's decoding of the transformer's (scaled) latents."""
    vae = wrapped("tae_hunyuanimage_refiner", recipe_files)
    transformer = HunyuanImageTransformer2DModel(
        in_channels=128,
        out_channels=64,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=(1, 1, 1),
        text_embed_dim=16,
        rope_axes_dim=(2, 2, 4),
        guidance_embeds=True,
    )
    pipe = HunyuanImageRefinerPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None, transformer=transformer
    )
    assert (pipe.vae_scale_factor, pipe.latent_channels) == (16, 64)
    image, prompt_embeds = torch.rand(1, 3, 32, 32), torch.randn(1, 4, 16)
    encoded = vae.encode(image.unsqueeze(2) * 2 - 1).latent_dist.sample()  # as its _encode_vae_image (raw)
    own = vae.tae.encode_video(image[:, None])[:, 0]
    torch.testing.assert_close(encoded[:, :, 0], own / vae.config.scaling_factor, atol=1e-6, rtol=0)

    def run(output_type: str) -> torch.Tensor:
        return pipe(
            image=image,
            prompt_embeds=prompt_embeds,
            prompt_embeds_mask=torch.ones(1, 4),
            height=32,
            width=32,
            num_inference_steps=1,
            output_type=output_type,
            generator=torch.Generator().manual_seed(0),
        ).images

    latents = run("latent")
    assert latents.shape == (1, 64, 1, 2, 2)
    frames = pipe._restore_image_tokens_order(latents)
    direct = vae.tae.decode_video(frames.permute(0, 2, 1, 3, 4))[:, 0]
    assert direct.shape == (1, 3, 32, 32)
    torch.testing.assert_close(run("pt"), direct.clamp(0, 1), atol=ROUNDING, rtol=0)


class SystemPromptProcessor:
    """Stands in for Qwen-Image 2.1's Qwen3-VL processor, whose tokenizer files come from the
    Hub: the pipeline's constructor only counts the system prompt's tokens with it; with
    prompt embeddings given, nothing else reads it."""

    class tokenizer:
        @staticmethod
        def encode(text: str) -> list[int]:
            return [0]

    @staticmethod
    def apply_chat_template(messages: list, tokenize: bool, return_dict: bool) -> list[list[int]]:
        return [[0, 1, 2]]


@torch.no_grad()
def test_qwenimage21_pipeline_generates_rgba_through_the_built_tae(recipe_files):
    """A whole QwenImage21Pipeline call with tae_qwenimage2_1: the pipeline unpacks its latent
    tokens into one 64-channel frame, un-normalises it with latents_mean/std and takes the
    one decoded frame; the image it returns is the TAE's RGBA decoding of the transformer's
    (normalised) latents."""
    vae = wrapped("tae_qwenimage2_1", recipe_files)
    transformer = QwenImage21Transformer2DModel(
        in_channels=64,
        out_channels=64,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        context_in_dim=16,
        axes_dims_rope=(2, 2, 4),
    )
    pipe = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=None,
        processor=SystemPromptProcessor(),
        transformer=transformer,
    )
    prompt_embeds = torch.randn(1, 4, 16)

    def run(output_type: str) -> torch.Tensor:
        return pipe(
            prompt_embeds=prompt_embeds,
            prompt_embeds_mask=torch.ones(1, 4),
            height=32,
            width=32,
            num_inference_steps=1,
            output_type=output_type,
            generator=torch.Generator().manual_seed(0),
        ).images

    latents = pipe._unpack_latents(run("latent"), 32, 32, pipe.vae_scale_factor)
    assert latents.shape == (1, 64, 1, 2, 2)
    direct = vae.tae.decode_video(latents.permute(0, 2, 1, 3, 4))[:, 0]
    assert direct.shape == (1, 4, 32, 32)  # RGBA
    torch.testing.assert_close(run("pt"), direct.clamp(0, 1), atol=ROUNDING, rtol=0)


def test_reference_vaes_whose_statistics_live_in_their_weights_need_the_pipelines_vae(recipe_files):
    """LTX's latents_mean/std are buffers of its VAE, Wan 2.2's 48 values are not the class
    defaults: without ``like=pipe.vae`` the wrapper says so instead of using wrong ones."""
    for variant, message in (("taeltx2_3", "pass like=<the pipeline's VAE>"), ("taew2_2", "has 16 channels")):
        with pytest.raises(ValueError, match=message):
            wrapped(variant, recipe_files)


def test_a_like_vae_of_another_latent_space_is_refused(recipe_files):
    """like= a Wan VAE with 4 latent channels for a 16-channel TAE: refused with both numbers,
    never a config whose z_dim is quietly rewritten."""
    import diffusers

    like = diffusers.AutoencoderKLWan(base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    with pytest.raises(ValueError, match="like= is a VAE with 4 latent channels, but taew2_1 has 16"):
        wrapped("taew2_1", recipe_files, like=like)


def test_taeos1_3_keeps_open_soras_statistics_beside_a_like_vae_of_another_model(recipe_files):
    """Diffusers has no Open-Sora 1.3 VAE, so like= is some other VAE of 16 channels: its
    config lays out the wrapper, and taeos1_3 still converts with Open-Sora 1.3's statistics."""
    import diffusers

    like = diffusers.AutoencoderKLWan(base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    assert wrapped("taeos1_3", recipe_files, like=like).transform == published_transform("taeos1_3")


def test_a_tae_with_a_space_of_its_own_is_refused_unless_a_space_is_named(tmp_path):
    """A TAE trained without a reference VAE has latents of its own: the wrapper refuses to
    pass it off as the pipeline's VAE, and takes it when the caller names the space."""
    torch.manual_seed(0)
    tae = TAEHV(variant="taew2_1")
    tae.latent_space = "own"
    path = save_weights(tae, tmp_path / "plain_autoencoder.safetensors")
    with pytest.raises(ValueError, match="trained without a reference VAE: its latents are its own"):
        TAEVideoVAE.from_file(path)
    assert TAEVideoVAE.from_file(path, latent_space="raw").transform.space == "raw"


def test_the_statistics_a_tae_was_trained_with_travel_in_its_file(tmp_path):
    """A taew2_2 trained here records the Wan 2.2 statistics it was normalised with: the
    wrapper converts with them without like= (the class defaults have 16 channels), and
    like= a VAE with other statistics takes precedence."""
    torch.manual_seed(0)
    tae = TAEHV(variant="taew2_2")
    tae.latent_transform = LatentTransform("normalised", 1.0, tuple(range(48)), (2.0,) * 48)
    vae = TAEVideoVAE.from_file(save_weights(tae, tmp_path / "taew2_2.safetensors"))
    assert vae.transform == tae.latent_transform
    raw = torch.randn(1, 48, 2, 2, 2)
    expected = vae.tae.decode_video(((raw - torch.arange(48.0).view(1, 48, 1, 1, 1)) / 2).permute(0, 2, 1, 3, 4))
    torch.testing.assert_close(vae.decode(raw).sample, expected.mul(2).sub(1).permute(0, 2, 1, 3, 4))


def test_a_tensor_of_another_layout_is_refused_with_the_shape_as_passed(recipe_files):
    """encode takes NCTHW videos and decode NCTHW latents (SVD: NCHW frames), as the diffusers
    VAE they stand in for: a tensor in another layout or with other channels is refused
    with the shape the caller passed, the layout and the channels expected."""
    vae = wrapped("taecvx", recipe_files)
    video = torch.zeros(1, 3, 9, 32, 32)
    with pytest.raises(
        ValueError,
        match=r"^TAEVideoVAE.encode takes NCTHW videos in \[-1, 1\] with 3 channels in dim 1 \(taecvx\), got shape "
        r"\(1, 9, 3, 32, 32\) \(this looks like NTCHW: pass x.permute\(0, 2, 1, 3, 4\)\)$",
    ):
        vae.encode(video.transpose(1, 2))
    with pytest.raises(ValueError, match=r"with 3 channels in dim 1 \(taecvx\), got shape \(1, 4, 9, 32, 32\)$"):
        vae.encode(torch.zeros(1, 4, 9, 32, 32))
    latents = vae.encode(video).latents
    assert latents.shape == (1, 16, 3, 4, 4) and vae.decode(latents).sample.shape == (1, 3, 9, 32, 32)
    with pytest.raises(
        ValueError,
        match=r"^TAEVideoVAE.decode takes NCTHW latents with 16 channels in dim 1 \(taecvx\), got shape "
        r"\(1, 3, 16, 4, 4\) \(this looks like NTCHW",
    ):
        vae.decode(latents.transpose(1, 2))
    images = wrapped("tae_svd", recipe_files)
    with pytest.raises(
        ValueError,
        match=r"encode takes NCHW images in \[-1, 1\] with 3 channels in dim 1 \(tae_svd\), "
        r"got shape \(1, 3, 1, 32, 32\)$",
    ):
        images.encode(torch.zeros(1, 3, 1, 32, 32))
