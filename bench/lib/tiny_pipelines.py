"""Real diffusers video pipelines with one-layer transformers, for tests and benchmarks on
CPU: no text encoder (prompt embeddings are given), any ``vae``. ``inputs`` are the call
arguments each pipeline needs besides the steps and the output type."""

from __future__ import annotations

import torch
from diffusers import (
    CogVideoXDDIMScheduler,
    CogVideoXPipeline,
    CogVideoXTransformer3DModel,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideoPipeline,
    HunyuanVideoTransformer3DModel,
    LTXPipeline,
    LTXVideoTransformer3DModel,
    WanPipeline,
    WanTransformer3DModel,
)


def wan_pipeline(vae: torch.nn.Module) -> WanPipeline:
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=16,
        out_channels=16,
        text_dim=16,
        freq_dim=16,
        ffn_dim=16,
        num_layers=1,
        rope_max_seq_len=32,
    )
    return WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


def cogvideox_pipeline(vae: torch.nn.Module) -> CogVideoXPipeline:
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=16,
        out_channels=16,
        text_embed_dim=16,
        time_embed_dim=4,
        num_layers=1,
        sample_width=4,
        sample_height=4,
        sample_frames=9,
        max_text_seq_length=4,
    )
    return CogVideoXPipeline(
        tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=CogVideoXDDIMScheduler()
    )


def hunyuan_pipeline(vae: torch.nn.Module) -> HunyuanVideoPipeline:
    transformer = HunyuanVideoTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 2, 4),
    )
    return HunyuanVideoPipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=None,
        tokenizer_2=None,
    )


def ltx_pipeline(vae: torch.nn.Module) -> LTXPipeline:
    transformer = LTXVideoTransformer3DModel(
        in_channels=128,
        out_channels=128,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=1,
        caption_channels=16,
    )
    return LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None, transformer=transformer
    )


def inputs(name: str) -> dict:
    """The call arguments of pipeline ``name`` ("wan", "cogvideox", "hunyuan", "ltx") for a
    9-frame clip: prompt embeddings drawn now, sizes, no classifier-free guidance."""
    embeds = {"prompt_embeds": torch.randn(1, 4, 16), "guidance_scale": 1.0, "num_frames": 9}
    if name in ("wan", "cogvideox"):
        return {**embeds, "height": 32, "width": 32}
    if name == "hunyuan":
        return {
            **embeds,
            "pooled_prompt_embeds": torch.randn(1, 8),
            "prompt_attention_mask": torch.ones(1, 4),
            "height": 32,
            "width": 32,
        }
    if name == "ltx":
        return {**embeds, "prompt_attention_mask": torch.ones(1, 4), "height": 64, "width": 64}
    raise ValueError(f"no tiny pipeline {name!r}: wan, cogvideox, hunyuan or ltx")


PIPELINES = {"wan": wan_pipeline, "cogvideox": cogvideox_pipeline, "hunyuan": hunyuan_pipeline, "ltx": ltx_pipeline}
