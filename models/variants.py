"""The published TAE family: which architecture each weight file needs.

Users name files as published (``taecvx.pth``, ``taehv1_5_super.pth``, ``taeltx2_3.pth``,
...), so the file name picks the variant unless ``variant=`` (or our safetensors
metadata) says otherwise. Each spec also carries the variant's frame rule
(``VariantSpec.plan``), the one the model, the config check and the tools ask.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

from .frames import FramePlan, plan_frames

logger = logging.getLogger(__name__)
ARCHES = ("base", "super", "wide")
FOUR_X, EIGHT_X = ((True, True, False), (False, True, True)), ((True, True, True), (True, True, True))


@dataclass(frozen=True)
class VariantSpec:
    name: str
    patch_size: int
    latent_channels: int
    arch: str = "base"  # decoder: "base", "super" (512..64, ConvNeXt-style blocks) or "wide" (1024..64)
    is_cogvideox: bool = False
    encoder_time_downscale: tuple[bool, ...] = FOUR_X[0]
    decoder_time_upscale: tuple[bool, ...] = FOUR_X[1]
    h3_chunks: bool = False  # MiniMax H3's chunked encode and decode (models.frames.H3_CHUNK_FRAMES)

    @property
    def t_downscale(self) -> int:
        return 2 ** sum(self.encoder_time_downscale)

    @property
    def t_upscale(self) -> int:
        return 2 ** sum(self.decoder_time_upscale)

    def plan(self, input_frames: int) -> FramePlan:
        """Frame counts and alignment for ``input_frames`` frames through this variant."""
        return plan_frames(input_frames, self.t_downscale, self.t_upscale, self.is_cogvideox, self.h3_chunks)


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
    "taeltx2_3_wide": VariantSpec("taeltx2_3_wide", 4, 128, arch="wide",
                                  encoder_time_downscale=EIGHT_X[0], decoder_time_upscale=EIGHT_X[1]),
}


def known_variants() -> list[str]:
    """All variant names accepted by ``variant=``."""
    return sorted([*BASE_VARIANTS, *(name + SUPER_SUFFIX for name in BASE_VARIANTS), *OTHER_VARIANTS])


def get_variant(name: str) -> VariantSpec:
    """The spec for a variant name; an unknown name raises with the valid list."""
    key = name.lower()
    if key in OTHER_VARIANTS:
        return OTHER_VARIANTS[key]
    base = key.removesuffix(SUPER_SUFFIX)
    if base not in BASE_VARIANTS:
        raise ValueError(f"unknown TAE variant {name!r}; known variants: {', '.join(known_variants())}")
    spec = BASE_VARIANTS[base]
    return replace(spec, name=key, arch="super") if key.endswith(SUPER_SUFFIX) else spec


def detect_variant(path: str | os.PathLike) -> str | None:
    """The variant a file name asks for, as users name the published files (the longest
    variant name in it: ``taeltx2_3_wide`` over ``taeltx2_3``, ``taehv1_5`` over
    ``taehv``), or None."""
    stem = Path(path).name.lower()
    matches = [name for name in known_variants() if name in stem]
    return max(matches, key=len) if matches else None


def custom_spec(metadata: dict[str, str]) -> VariantSpec:
    """The architecture our safetensors metadata describes for a ``custom`` model."""
    return VariantSpec(
        "custom",
        int(metadata["patch_size"]),
        int(metadata["latent_channels"]),
        metadata.get("arch_variant", "base"),
        metadata.get("is_cogvideox", "false") == "true",
        encoder_time_downscale=tuple(json.loads(metadata.get("encoder_time_downscale", "[true, true, false]"))),
        decoder_time_upscale=tuple(json.loads(metadata.get("decoder_time_upscale", "[false, true, true]"))),
        h3_chunks=metadata.get("h3_chunks", "false") == "true",
    )


def resolve_variant(
    variant: str | None,
    checkpoint_path: str | os.PathLike | None,
    patch_size: int,
    latent_channels: int,
    arch: str | None,
    metadata: dict[str, str] | None = None,
) -> VariantSpec:
    """Pick the architecture: explicit ``variant`` > file metadata > file name > arguments.
    ``arch`` "super" with a base variant's file name gives that variant's super decoder
    (as the published constructor's ``arch_variant="super"`` does); None means "base"."""
    if arch is not None and arch not in ARCHES:
        raise ValueError(f"arch_variant must be one of {', '.join(ARCHES)}, got {arch!r}")
    if variant is not None:
        return get_variant(variant)
    if metadata and metadata.get("variant"):
        return custom_spec(metadata) if metadata["variant"] == "custom" else get_variant(metadata["variant"])
    if checkpoint_path is not None and (detected := detect_variant(checkpoint_path)):
        if arch == "super" and detected in BASE_VARIANTS:
            detected += SUPER_SUFFIX
        logger.info("variant %s selected from file name %s", detected, Path(checkpoint_path).name)
        return get_variant(detected)
    return VariantSpec("custom", patch_size, latent_channels, arch or "base")
