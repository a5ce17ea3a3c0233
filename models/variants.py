"""The published TAEHV family: which architecture each weight file needs.

Users name files as published (``taecvx.pth``, ``taehv1_5_super.pth``, ...), so the file
name picks the variant unless ``variant=`` (or our safetensors metadata) says otherwise.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VariantSpec:
    name: str
    patch_size: int
    latent_channels: int
    arch: str = "base"  # "base" or "super" decoder
    is_cogvideox: bool = False
    reference: str = ""  # the reference VAE whose latent space it lives in


BASE_VARIANTS = {
    "taehv": VariantSpec("taehv", 1, 16, reference="HunyuanVideo"),
    "taew2_1": VariantSpec("taew2_1", 1, 16, reference="Wan 2.1"),
    "taeos1_3": VariantSpec("taeos1_3", 1, 16, reference="Open-Sora 1.3"),
    "taecvx": VariantSpec("taecvx", 1, 16, is_cogvideox=True, reference="CogVideoX"),
    "taehv1_5": VariantSpec("taehv1_5", 2, 32, reference="HunyuanVideo 1.5"),
    "taew2_2": VariantSpec("taew2_2", 2, 48, reference="Wan 2.2"),
}
SUPER_SUFFIX = "_super"
UNSUPPORTED = {
    "taeh3": "TAEH3 uses a different temporal chunking",
    "taeltx": "TAELTX uses a different temporal chunking and patch size",
}


def known_variants() -> list[str]:
    """All variant names accepted by ``variant=`` (each base variant also with ``_super``)."""
    return sorted([*BASE_VARIANTS, *(name + SUPER_SUFFIX for name in BASE_VARIANTS)])


def get_variant(name: str) -> VariantSpec:
    """The spec for a variant name; unsupported or unknown names raise with the valid list."""
    key = name.lower()
    _reject_unsupported(key, f"variant {name!r}")
    base = key.removesuffix(SUPER_SUFFIX)
    if base not in BASE_VARIANTS:
        raise ValueError(f"unknown TAEHV variant {name!r}; known variants: {', '.join(known_variants())}")
    spec = BASE_VARIANTS[base]
    return replace(spec, name=key, arch="super") if key.endswith(SUPER_SUFFIX) else spec


def detect_variant(path: str | os.PathLike) -> str | None:
    """The variant a file name asks for, as users name the published files, or None."""
    stem = Path(path).name.lower()
    _reject_unsupported(stem, f"checkpoint {Path(path).name!r}")
    matches = [name for name in BASE_VARIANTS if name in stem]
    if not matches:
        return None
    base = max(matches, key=len)  # "taehv1_5" beats "taehv"
    return base + SUPER_SUFFIX if SUPER_SUFFIX in stem else base


def _reject_unsupported(text: str, what: str) -> None:
    for prefix, why in UNSUPPORTED.items():
        if prefix in text:
            raise NotImplementedError(
                f"{what} is a {prefix} model, which is not supported: {why}. "
                f"Supported variants: {', '.join(known_variants())}"
            )


def resolve_variant(
    variant: str | None,
    checkpoint_path: str | os.PathLike | None,
    patch_size: int,
    latent_channels: int,
    arch: str,
    metadata: dict[str, str] | None = None,
) -> VariantSpec:
    """Pick the architecture: explicit ``variant`` > file metadata > file name > arguments."""
    if arch not in ("base", "super"):
        raise ValueError(f"arch_variant must be 'base' or 'super', got {arch!r}")
    if variant is not None:
        return get_variant(variant)
    if metadata and metadata.get("variant"):
        if metadata["variant"] != "custom":
            return get_variant(metadata["variant"])
        return VariantSpec(
            "custom",
            int(metadata["patch_size"]),
            int(metadata["latent_channels"]),
            metadata.get("arch_variant", "base"),
            metadata.get("is_cogvideox", "false") == "true",
        )
    if checkpoint_path is not None and (detected := detect_variant(checkpoint_path)):
        logger.info("variant %s selected from file name %s", detected, Path(checkpoint_path).name)
        return get_variant(detected)
    return VariantSpec("custom", patch_size, latent_channels, arch)
