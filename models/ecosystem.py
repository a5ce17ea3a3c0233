"""How other tools take a TAE weight file: ComfyUI, LightX2V and the published ``taehv.py``.

None of them reads our metadata: they tell the model, and which latents to hand it, from
the file's name, its tensors' shapes and its dtype. The export bundle names and types its
files so that they take each TAE as what it is (``export_stem``, ``comfyui_dtype``), and
its model card says how to load it where their rules cannot tell (``readings``). The
rules, from their sources (docs/reference_vaes.md, "Which latents go in"):

- ComfyUI ``comfy/sd.py`` (the ``"decoder.22.bias" in sd`` branch) with
  ``comfy/taesd/taehv.py`` and ``comfy/latent_formats.py``: 48 or 128 latent channels get no
  latent format (VAEDecode hands them ComfyUI's latents: raw for Wan 2.2, normalised for
  LTX, whose ComfyUI VAE normalises inside); 32 channels with 12 outputs are LightX2V's
  HunyuanVideo 1.5 TAE (LeakyReLU, pixels in [-1, 1], HunyuanVideo15's scale: scaled
  latents); 16 channels in fp16 are TAEHV (HunyuanVideo's scale: scaled latents), in other
  dtypes LightX2V's lighttaew2_1 (raw latents). Its live previews hand the TAE the sampler's
  latents (the model's space) through the same format.
- LightX2V ``lightx2v/pipeline.py`` and ``models/video_encoders/hf/wan/vae_tiny.py``: a Wan
  TAE whose path contains ``lighttae`` gets raw latents (``need_scaled``), any other the
  runner's normalised ones; its HunyuanVideo 1.5 TAE (``lighttae_hy15.py``) gets raw latents.
- madebyollin/taehv ``taehv.py``: the architecture from the file name (``taecvx``,
  ``taeh3``, ``taew2_2``, ``taehv1_5``, ``taeltx``, ``_super``), ReLU, pixels in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .latent_spaces import NORMALISED, OWN, RAW, SCALED
from .vae_registry import OWN_SUFFIX, ref_vae_class_of
from .variants import built_family


@dataclass(frozen=True)
class Reading:
    """What one tool makes of a file: the network it builds and the latents it decodes."""

    tool: str
    activation: str
    space: str | None  # None: a space the tool does not define for this file
    how: str  # what it builds, in words


def export_stem(variant: str, space: str | None) -> str:
    """The file name (without suffix) that other tools read as this TAE in this space: a Wan
    TAE on raw latents is LightX2V's (``lighttaew2_*``), on normalised ones madebyollin's
    (``taew2_*``); a TAE with a latent space of its own is ``<variant>_own_latents`` (the
    variant still gives its architecture, the suffix keeps it from passing for the video
    model's TAE, and ``file_space`` reads it back); every other TAE keeps its variant's name."""
    if space == OWN:
        return f"{variant}{OWN_SUFFIX}"
    base = variant.removeprefix("light") if variant.startswith("lighttaew2") else variant
    if base.startswith("taew2_") and not base.endswith("_super"):
        return f"light{base}" if space == RAW else base
    return variant


def comfyui_dtype(latent_channels: int, space: str | None, activation: str) -> torch.dtype:
    """fp16 for a 16-channel TAE on scaled latents (ComfyUI applies HunyuanVideo's scale to
    16-channel fp16 files only), fp32 otherwise (fp16 would make ComfyUI scale it)."""
    return torch.float16 if latent_channels == 16 and space == SCALED and activation == "relu" else torch.float32


def comfyui_reading(latent_channels: int, outputs: int, dtype: torch.dtype, ref_vae_class: str | None) -> Reading:
    """What ComfyUI builds from a TAE file with these shapes and dtype, and which latents its
    VAEDecode hands it (``comfy/sd.py``, the ``"decoder.22.bias" in sd`` branch)."""
    if latent_channels in (48, 128):
        return Reading("ComfyUI", "relu", NORMALISED if ref_vae_class in ("ltx", "ltx2") else RAW, "no latent format")
    if latent_channels == 32 and outputs == 12:
        return Reading("ComfyUI", "leaky_relu", SCALED, "lighttae_hv15 (LeakyReLU, HunyuanVideo15's scale)")
    if dtype == torch.float16:
        return Reading("ComfyUI", "relu", SCALED, "taehv (HunyuanVideo's scale)")
    return Reading("ComfyUI", "relu", RAW, "lighttaew2_1 (no latent format)")


def lightx2v_reading(file_name: str, variant: str) -> Reading | None:
    """Which latents LightX2V hands a TAE file it runs (Wan and HunyuanVideo 1.5), None for
    the models it has no TAE for."""
    ref_vae_class = ref_vae_class_of(variant)
    if ref_vae_class == "wan":
        light = "lighttae" in file_name
        return Reading("LightX2V", "relu", RAW if light else NORMALISED, "need_scaled" if light else "taew2_*")
    if ref_vae_class == "hunyuan15":
        return Reading("LightX2V", "leaky_relu", RAW, "LightTaeHy15 (LeakyReLU, divides by scaling_factor)")
    return None


def readings(file_name: str, variant: str, latent_channels: int, patch_size: int, dtype: torch.dtype) -> list[Reading]:
    """ComfyUI's and LightX2V's readings of an exported file."""
    ref_vae_class = ref_vae_class_of(variant)
    found = [comfyui_reading(latent_channels, 3 * patch_size**2, dtype, ref_vae_class)]
    lightx2v = lightx2v_reading(file_name, variant)
    return found + ([lightx2v] if lightx2v else [])


def published_loads(variant: str, activation: str) -> bool:
    """Whether madebyollin's ``taehv.py`` builds this TAE from its file name: the published
    families with ReLU (not LightX2V's LeakyReLU TAE, not the TAEs this package builds)."""
    return activation == "relu" and built_family(variant) is None
