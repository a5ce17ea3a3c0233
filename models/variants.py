"""The TAE family: which architecture each weight file needs.

Users name files as published (``taecvx.pth``, ``taehv1_5_super.pth``, ``taeltx2_3.pth``,
LightX2V's ``lighttaew2_1.pth``, ...), so the file name picks the variant unless
``variant=`` (or our safetensors metadata) says otherwise. Reference VAEs with no published
TAE get one built from their latent space (``BUILT_FAMILIES``: ``tae_mochi``,
``tae_vidtok_c16_s8_t4``, ...). Each spec also carries the variant's frame rule
(``VariantSpec.plan``), the one the model, the config check and the tools ask.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from .frames import FramePlan, exact_frame_counts, plan_frames

logger = logging.getLogger(__name__)
ARCH_VARIANTS = ("base", "super", "wide")
FOUR_X, EIGHT_X = ((True, True, False), (False, True, True)), ((True, True, True), (True, True, True))


def time_strides(switches: tuple[bool | int, ...]) -> tuple[int, ...]:
    """Per-stage temporal strides from the published switches (True: 2, False: 1) or from
    strides given as numbers (3 for the 3x stage of a 6x time axis)."""
    strides = tuple((2 if s else 1) if isinstance(s, bool) else int(s) for s in switches)
    if any(s < 1 for s in strides):
        raise ValueError(f"temporal strides must be True/False or whole numbers >= 1, got {switches}")
    return strides


def time_switches(strides: tuple[int, ...]) -> tuple[bool | int, ...]:
    """The published form (booleans) where strides of 1 and 2 say it all, else the strides."""
    return tuple(s == 2 for s in strides) if set(strides) <= {1, 2} else tuple(strides)


@dataclass(frozen=True)
class VariantSpec:
    name: str
    patch_size: int
    latent_channels: int
    arch_variant: str = "base"  # decoder: "base", "super" (512..64, ConvNeXt-style blocks) or "wide" (1024..64)
    is_cogvideox: bool = False
    encoder_time_downscale: tuple[bool | int, ...] = FOUR_X[0]  # per stage: True/False (2x/1x) or a stride
    decoder_time_upscale: tuple[bool | int, ...] = FOUR_X[1]
    h3_chunks: bool = False  # MiniMax H3's chunked encode and decode (models.frames.H3_CHUNK_FRAMES)
    image_channels: int = 3  # 4: RGBA
    causal: bool = True  # False: no leading decoded frames to trim (T = t_downscale * latents both ways)
    activation: str = "relu"  # every nonlinearity: "relu" (published) or "leaky_relu" (LeakyReLU(0.2): lighttaehy1_5)
    signed_pixels: bool = False  # the network's own pixels are in [-1, 1] (the model's API stays [0, 1])

    @property
    def t_downscale(self) -> int:
        return math.prod(time_strides(self.encoder_time_downscale))

    @property
    def t_upscale(self) -> int:
        return math.prod(time_strides(self.decoder_time_upscale))

    def plan(self, input_frames: int) -> FramePlan:
        """Frame counts and alignment for ``input_frames`` frames through this variant."""
        return plan_frames(
            input_frames, self.t_downscale, self.t_upscale, self.is_cogvideox, self.h3_chunks, self.causal
        )

    def exact_frame_counts(self, limit: int) -> list[int]:
        """Input frame counts up to ``limit`` that decode to exactly themselves."""
        return exact_frame_counts(
            limit, self.t_downscale, self.t_upscale, self.is_cogvideox, self.h3_chunks, self.causal
        )


BASE_VARIANTS = {
    "taehv": VariantSpec("taehv", 1, 16),
    "taew2_1": VariantSpec("taew2_1", 1, 16),
    "taeos1_3": VariantSpec("taeos1_3", 1, 16),
    "taecvx": VariantSpec("taecvx", 1, 16, is_cogvideox=True),
    "taehv1_5": VariantSpec("taehv1_5", 2, 32),
    "taew2_2": VariantSpec("taew2_2", 2, 48),
}
SUPER_SUFFIX = "_super"  # every base variant also exists with the "super" decoder
OTHER_VARIANTS = {
    "taeh3": VariantSpec("taeh3", 2, 24, h3_chunks=True),
    "taeltx_2": VariantSpec("taeltx_2", 4, 128, encoder_time_downscale=EIGHT_X[0], decoder_time_upscale=EIGHT_X[1]),
    "taeltx2_3": VariantSpec("taeltx2_3", 4, 128, encoder_time_downscale=EIGHT_X[0], decoder_time_upscale=EIGHT_X[1]),
    "taeltx2_3_wide": VariantSpec(
        "taeltx2_3_wide",
        4,
        128,
        arch_variant="wide",
        encoder_time_downscale=EIGHT_X[0],
        decoder_time_upscale=EIGHT_X[1],
    ),
}
# LightX2V's LightTAE weights (published by ModelTC, no super decoder): taew2_1's and taew2_2's
# networks for raw Wan latents (models.latent_spaces), and a HunyuanVideo 1.5 TAE with
# LeakyReLU(0.2) everywhere and pixels in [-1, 1] both ways (LightX2V's tae.py, ComfyUI's taehv.py).
LIGHT_VARIANTS = {
    "lighttaew2_1": VariantSpec("lighttaew2_1", 1, 16),
    "lighttaew2_2": VariantSpec("lighttaew2_2", 2, 48),
    "lighttaehy1_5": VariantSpec("lighttaehy1_5", 2, 32, activation="leaky_relu", signed_pixels=True),
}


@dataclass(frozen=True)
class BuiltFamily:
    """A reference VAE with no published TAE: the latent space of its released model (a
    TAE for another configuration of it is named by what differs, ``built_name``), and
    what its frames and pixels are."""

    latent_channels: int
    spatial_compression: int
    temporal_compression: int
    image_channels: int = 3
    causal: bool = True


# The TAEs this package builds for diffusers video VAEs that have none published
# (docs/reference_vaes.md); models.vae_classes says which class each belongs to.
BUILT_FAMILIES = {
    "tae_allegro": BuiltFamily(4, 8, 4, causal=False),
    "tae_cosmos": BuiltFamily(16, 8, 8),
    "tae_kvae": BuiltFamily(16, 8, 4),
    "tae_easyanimate": BuiltFamily(16, 8, 4),
    "tae_vidtok": BuiltFamily(4, 8, 4),
    "tae_mochi": BuiltFamily(12, 8, 6),
    "tae_qwenimage2_1": BuiltFamily(64, 16, 1, image_channels=4),
    "tae_svd": BuiltFamily(4, 8, 1),
    "tae_hunyuanimage_refiner": BuiltFamily(32, 16, 1, causal=False),
}
_BUILT_NAME = re.compile(r"(tae_[a-z0-9_]+?)(?:_c(\d+)_s(\d+)_t(\d+))?")
PATCH_SIZES = {8: 1, 16: 2, 32: 4}  # spatial compression -> pixel-unshuffle factor before the 8x encoder


def split_time(factor: int) -> tuple[int, int, int]:
    """Encoder strides of the three stages for a temporal compression: 2x and 3x stages, the
    largest first (6 -> 2, 3, 1 as Mochi; 8 -> 2, 2, 2); ValueError when three such stages
    cannot make it."""
    strides, rest = [], factor
    for prime in (2, 3):
        while rest % prime == 0:
            strides.append(prime)
            rest //= prime
    if rest != 1 or len(strides) > 3 or factor < 1:
        raise ValueError(
            f"a {factor}x time axis is not a product of at most three 2x or 3x stages, which is what the "
            "TAE's three encoder and decoder stages can pool and grow"
        )
    strides.sort(key=lambda s: s != 2)  # 2x stages first (pooling the most frames earliest)
    return tuple(strides + [1] * (3 - len(strides)))


def built_family(name: str) -> str | None:
    """The family of a built TAE name (``tae_vidtok_c16_s8_t4`` -> ``tae_vidtok``), else None."""
    match = _BUILT_NAME.fullmatch(name)
    return match.group(1) if match and match.group(1) in BUILT_FAMILIES else None


def built_name(family: str, latent_channels: int, spatial: int, temporal: int) -> str:
    """``family`` for its released latent space, else ``family_c<L>_s<S>_t<T>``."""
    base = BUILT_FAMILIES[family]
    if (latent_channels, spatial, temporal) == (
        base.latent_channels,
        base.spatial_compression,
        base.temporal_compression,
    ):
        return family
    return f"{family}_c{latent_channels}_s{spatial}_t{temporal}"


def built_spec(name: str) -> VariantSpec | None:
    """The architecture of a built TAE name (``tae_mochi``, ``tae_vidtok_c16_s8_t4``), None
    for other names; ValueError when the TAE structure cannot express its latent space."""
    if built_family(name) is None:
        return None
    match = _BUILT_NAME.fullmatch(name)
    family = BUILT_FAMILIES[match.group(1)]
    latent_channels, spatial, temporal = (
        (int(v) for v in match.group(2, 3, 4))
        if match.group(2)
        else (family.latent_channels, family.spatial_compression, family.temporal_compression)
    )
    if spatial not in PATCH_SIZES:
        raise ValueError(
            f"{name}: a {spatial}x spatial compression is not one the TAE expresses (8x, 16x or 32x: "
            "its 8x encoder after a pixel-unshuffle by 1, 2 or 4)"
        )
    strides = split_time(temporal)
    return VariantSpec(
        name,
        PATCH_SIZES[spatial],
        latent_channels,
        encoder_time_downscale=time_switches(strides),
        decoder_time_upscale=time_switches(strides[::-1]),
        image_channels=family.image_channels,
        causal=family.causal,
    )


def known_variants() -> list[str]:
    """All variant names accepted by ``variant=``: the published TAEHV ones, LightX2V's, then the
    built ones (for their released latent space), so that a weight file that fits several is
    named by its published TAEHV variant first (a taehv1_5 file also fits lighttaehy1_5's keys)."""
    published = sorted([*BASE_VARIANTS, *(name + SUPER_SUFFIX for name in BASE_VARIANTS), *OTHER_VARIANTS])
    return published + sorted(LIGHT_VARIANTS) + sorted(BUILT_FAMILIES)


def get_variant(name: str) -> VariantSpec:
    """The spec for a variant name; an unknown name raises with the valid list."""
    key = name.lower()
    if (spec := OTHER_VARIANTS.get(key) or LIGHT_VARIANTS.get(key)) is not None:
        return spec
    if (built := built_spec(key)) is not None:
        return built
    base = key.removesuffix(SUPER_SUFFIX)
    if base not in BASE_VARIANTS:
        raise ValueError(f"unknown TAE variant {name!r}; known variants: {', '.join(known_variants())}")
    spec = BASE_VARIANTS[base]
    return replace(spec, name=key, arch_variant="super") if key.endswith(SUPER_SUFFIX) else spec


def detect_variant(path: str | os.PathLike) -> str | None:
    """The variant a file name asks for, as users name the published files (the longest
    variant name in it: ``taeltx2_3_wide`` over ``taeltx2_3``, ``taehv1_5`` over
    ``taehv``, ``lighttaew2_1`` over ``taew2_1``), or None."""
    stem = Path(path).name.lower()
    matches = [name for name in known_variants() if name in stem]
    matches += [
        m.group(0)
        for family in BUILT_FAMILIES  # a built TAE for another configuration
        if (m := re.search(rf"{family}_c\d+_s\d+_t\d+", stem))
    ]
    return max(matches, key=len) if matches else None


def custom_spec(metadata: dict[str, str], name: str = "custom") -> VariantSpec:
    """The architecture our safetensors metadata describes (a ``custom`` model, or one whose
    name this version does not know)."""
    return VariantSpec(
        name,
        int(metadata["patch_size"]),
        int(metadata["latent_channels"]),
        metadata.get("arch_variant", "base"),
        metadata.get("is_cogvideox", "false") == "true",
        encoder_time_downscale=tuple(json.loads(metadata.get("encoder_time_downscale", "[true, true, false]"))),
        decoder_time_upscale=tuple(json.loads(metadata.get("decoder_time_upscale", "[false, true, true]"))),
        h3_chunks=metadata.get("h3_chunks", "false") == "true",
        image_channels=int(metadata.get("image_channels", "3")),
        causal=metadata.get("causal", "true") == "true",
        activation=metadata.get("activation", "relu"),
        signed_pixels=metadata.get("signed_pixels", "false") == "true",
    )


def resolve_variant(
    variant: str | None,
    checkpoint_path: str | os.PathLike | None,
    patch_size: int,
    latent_channels: int,
    arch_variant: str | None,
    metadata: dict[str, str] | None = None,
) -> VariantSpec:
    """Pick the architecture: explicit ``variant`` > file metadata > file name > arguments.
    ``arch_variant`` "super" with a base variant's file name gives that variant's super decoder
    (as the published constructor's ``arch_variant="super"`` does); None means "base"."""
    if arch_variant is not None and arch_variant not in ARCH_VARIANTS:
        raise ValueError(f"arch_variant must be one of {', '.join(ARCH_VARIANTS)}, got {arch_variant!r}")
    if variant is not None:
        return get_variant(variant)
    if metadata and metadata.get("variant"):
        name = metadata["variant"]  # a name this version does not know is built from the metadata alone
        known = name != "custom" and (name in known_variants() or built_spec(name) is not None)
        return get_variant(name) if known else custom_spec(metadata, name)
    if checkpoint_path is not None and (detected := detect_variant(checkpoint_path)):
        if arch_variant == "super" and detected in BASE_VARIANTS:
            detected += SUPER_SUFFIX
        logger.info("variant %s selected from file name %s", detected, Path(checkpoint_path).name)
        return get_variant(detected)
    if checkpoint_path is not None:
        logger.warning(
            "%s names no variant and has no metadata or run config.json: built as custom (patch %d, %d latent "
            "channels); pass variant= to build another",
            checkpoint_path,
            patch_size,
            latent_channels,
        )
    return VariantSpec("custom", patch_size, latent_channels, arch_variant or "base")
