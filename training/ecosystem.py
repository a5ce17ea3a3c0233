"""How other tools take a TAE weight file: ComfyUI, LightX2V and the published ``taehv.py``.

None of them reads our metadata: they tell the model, and which latents to hand it, from
the file's name, its tensors' shapes and its dtype. The export bundle names and types its
files so that they take each TAE as what it is (``export_stem``, ``comfyui_dtype``), and
its model card says how to load it where their rules cannot tell (``readings``,
``comfyui_preview``). The rules, from their sources (docs/reference_vaes.md, "Which
latents go in" and "ComfyUI: previews and VAEDecode"):

- ComfyUI ``comfy/sd.py`` (the ``"decoder.22.bias" in sd`` branch) with
  ``comfy/taesd/taehv.py`` and ``comfy/latent_formats.py``: a TAE file becomes a VAE whose
  ``decode`` applies the file's own latent format's ``process_in`` to what it is handed.
  24 latent channels with 12 outputs are MiniMax H3's taeh3, 48 or 128 channels Wan 2.2's
  and LTX-2's: no latent format; 32 channels with 12 outputs are LightX2V's HunyuanVideo
  1.5 TAE (LeakyReLU, pixels in [-1, 1], HunyuanVideo15's scale: scaled latents); 16
  channels in fp16 are TAEHV (HunyuanVideo's scale: scaled latents), in other dtypes
  LightX2V's lighttaew2_1 (no latent format). VAEDecode hands the file ComfyUI's LATENT:
  what ComfyUI's own VAE encodes (``COMFYUI_MODELS``): raw latents, but normalised ones for
  LTX and MiniMax H3, whose ComfyUI VAEs normalise inside.
- ComfyUI ``latent_preview.py``: the live preview of a model whose latent format names a
  ``taesd_decoder_name`` loads the first file of ``models/vae_approx`` (names in sorted
  order, ``folder_paths.get_filename_list``) that starts with that name, as the VAE loader
  would (the rules above), and ``TAEHVPreviewerImpl`` decodes the first latent frame of
  the sampler's denoised estimate ``x0`` (the model's space) taken back through the
  model's ``latent_format.process_out``: ComfyUI's LATENT again, so the file gets what
  VAEDecode hands it, one latent frame without the frames before it. For Wan the file gets
  raw latents, so a Wan TAE in the default normalised space has no core ComfyUI route;
  one trained with ``latent_space=raw`` is exported as ``lighttaew2_*``, the name Wan's
  preview looks for.
- LightX2V ``lightx2v/pipeline.py`` and ``models/video_encoders/hf/wan/vae_tiny.py``: a Wan
  TAE whose path contains ``lighttae`` gets raw latents (``need_scaled``), any other the
  runner's normalised ones; its HunyuanVideo 1.5 TAE (``lighttae_hy15.py``) gets raw latents.
- madebyollin/taehv ``taehv.py``: the architecture from the file name (``taecvx``,
  ``taeh3``, ``taew2_2``, ``taehv1_5``, ``taeltx``, ``_super``), ReLU, pixels in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from taehv_train.models.latent_spaces import NORMALISED, OWN, RAW, SCALED
from taehv_train.models.vae_registry import OWN_SUFFIX, ref_vae_class_of
from taehv_train.models.variants import SUPER_SUFFIX, built_family


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


@dataclass(frozen=True)
class ComfyModel:
    """A video model as ComfyUI holds it: its latent format (``comfy/latent_formats.py``),
    the space of its LATENT (what ComfyUI's VAE for it encodes and VAEDecode takes), and
    the name its live preview looks for in ``models/vae_approx`` (``taesd_decoder_name``;
    None: the format names none, so no TAE previews it)."""

    latent_format: str
    latents: str
    preview_name: str | None


# the video model of each published TAE family, as ComfyUI holds it (Comfy-Org/ComfyUI
# comfy/latent_formats.py at 9a9a69fd: Wan21/Wan22/HunyuanVideo/HunyuanVideo15/CogVideoX map
# their LATENT into the model's space in process_in, so it is raw; MiniMaxH3Video and LTXV
# keep it as ComfyUI's VAE gives it, normalised: comfy/ldm/minimax/vae.py at 3bd3ca17,
# MiniMaxH3VideoVAE.encode returns (mean - latents_mean) / latents_std and decode undoes it;
# LTX's decoder un-normalises first, per_channel_statistics.un_normalize in
# comfy/ldm/lightricks/vae/causal_video_autoencoder.py)
_WAN21, _WAN22 = ComfyModel("Wan21", RAW, "lighttaew2_1"), ComfyModel("Wan22", RAW, "lighttaew2_2")
_HUNYUAN15, _LTX = ComfyModel("HunyuanVideo15", RAW, "lighttaehy1_5"), ComfyModel("LTXV", NORMALISED, None)
COMFYUI_MODELS = {
    "taehv": ComfyModel("HunyuanVideo", RAW, "taehv"),
    "taew2_1": _WAN21,
    "lighttaew2_1": _WAN21,
    "taew2_2": _WAN22,
    "lighttaew2_2": _WAN22,
    "taehv1_5": _HUNYUAN15,
    "lighttaehy1_5": _HUNYUAN15,
    "taeh3": ComfyModel("MiniMaxH3Video", NORMALISED, "taeh3"),
    "taecvx": ComfyModel("CogVideoX", RAW, None),
    "taeltx_2": _LTX,
    "taeltx2_3": _LTX,
    "taeltx2_3_wide": _LTX,
}


def comfyui_model(variant: str) -> ComfyModel | None:
    """The ComfyUI model a TAE variant (a super decoder too) belongs to; None for the TAEs
    of models ComfyUI previews with no TAE of this family (Open-Sora, the built ones)."""
    return COMFYUI_MODELS.get(variant.removesuffix(SUPER_SUFFIX))


def comfyui_reading(latent_channels: int, outputs: int, dtype: torch.dtype, variant: str) -> Reading:
    """What ComfyUI builds from a TAE file with these shapes and dtype, and which latents it
    decodes from ComfyUI's LATENT of the variant's model (``comfy/sd.py``, the
    ``"decoder.22.bias" in sd`` branch): the file's own latent format's ``process_in`` of it."""
    model = comfyui_model(variant)
    latents = model.latents if model else RAW
    if latent_channels == 24 and outputs == 12:
        return Reading("ComfyUI", "relu", latents, "taeh3 (no latent format)")
    if latent_channels in (48, 128):
        return Reading("ComfyUI", "relu", latents, "no latent format")
    if latent_channels == 32 and outputs == 12:
        return Reading("ComfyUI", "leaky_relu", SCALED, "lighttae_hv15 (LeakyReLU, HunyuanVideo15's scale)")
    if dtype == torch.float16:
        return Reading("ComfyUI", "relu", SCALED, "taehv (HunyuanVideo's scale)")
    return Reading("ComfyUI", "relu", latents, "lighttaew2_1 (no latent format)")


@dataclass(frozen=True)
class Preview:
    """The files ComfyUI's live preview of a model could take (``latent_preview.py``,
    ``get_previewer``): those whose name starts with the model's ``preview_name``, in the
    sorted order it lists them; it takes the first."""

    model: ComfyModel
    candidates: tuple[str, ...]


def comfyui_preview(file_names: list[str], variant: str) -> Preview | None:
    """The preview of the variant's own model; None where ComfyUI has no TAE preview for it."""
    model = comfyui_model(variant)
    if model is None or model.preview_name is None:
        return None
    return Preview(model, tuple(name for name in sorted(file_names) if name.startswith(model.preview_name)))


def previews_taking(file_names: list[str], variant: str) -> dict[ComfyModel, tuple[str, ...]]:
    """Other models whose live preview would take some of these files by their names
    (``taehv1_5*`` starts with HunyuanVideo's ``taehv``), with those files: in
    ``models/vae_approx`` next to such a model, they are decoded as that model's TAE."""
    own = comfyui_model(variant)
    others = {model for model in COMFYUI_MODELS.values() if model.preview_name and model != own}
    taken = {m: tuple(n for n in sorted(file_names) if n.startswith(m.preview_name)) for m in others}
    return {model: names for model, names in sorted(taken.items(), key=lambda kv: kv[0].latent_format) if names}


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
    found = [comfyui_reading(latent_channels, 3 * patch_size**2, dtype, variant)]
    lightx2v = lightx2v_reading(file_name, variant)
    return found + ([lightx2v] if lightx2v else [])


def published_loads(variant: str, activation: str) -> bool:
    """Whether madebyollin's ``taehv.py`` builds this TAE from its file name: the published
    families with ReLU (not LightX2V's LeakyReLU TAE, not the TAEs this package builds)."""
    return activation == "relu" and built_family(variant) is None
