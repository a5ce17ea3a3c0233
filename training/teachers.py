"""The diffusers video VAEs a TAE learns from, and what each one's config says about it.

Everything here is read from the model folder's ``config.json`` alone (no weights are
loaded), so the launch script's pre-flight can check a teacher before anything starts:
its diffusers class, latent channels, spatial and temporal compression (hence the frame
rule), and which TAE variants live in its latent space. ``ref_vae_class`` names one of
``TEACHERS``; ``variant="auto"`` takes the teacher's own TAE.

The latents are the raw ones ``vae.encode(...).latent_dist`` gives: every pipeline
un-scales (``scaling_factor``) or un-normalises (``latents_mean``/``latents_std``) its
latents before ``vae.decode``, so a TAE trained on raw latents decodes what the pipeline
passes to ``vae.decode`` (checked per pipeline in docs/teachers.md).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from models.variants import VariantSpec, get_variant, known_variants


@dataclass(frozen=True)
class Teacher:
    diffusers_class: str
    variants: tuple[str, ...]  # its published TAEs, the first that fits is taken by variant="auto"
    pixels: str = "signed"  # "signed": [-1, 1]; "imagenet": ImageNet-normalised [0, 1] (MiniMax H3)
    model: str = ""  # the video model it belongs to, for messages and docs
    one_clip_at_a_time: bool = False  # diffusers 0.42's HunyuanVideo 1.5 attention mask breaks on batches > 1


TEACHERS = {
    "cogvideox": Teacher("AutoencoderKLCogVideoX", ("taecvx",), model="CogVideoX"),
    "hunyuan": Teacher("AutoencoderKLHunyuanVideo", ("taehv",), model="HunyuanVideo"),
    "hunyuan15": Teacher("AutoencoderKLHunyuanVideo15", ("taehv1_5",), model="HunyuanVideo 1.5", one_clip_at_a_time=True),
    "wan": Teacher("AutoencoderKLWan", ("taew2_1", "taew2_2"), model="Wan 2.1 (16 channels) / Wan 2.2 5B (48)"),
    "ltx": Teacher("AutoencoderKLLTXVideo", ("taeltx_2",), model="LTX-Video"),
    "ltx2": Teacher("AutoencoderKLLTX2Video", ("taeltx2_3", "taeltx_2"), model="LTX-2 / LTX-2.3"),
    "h3": Teacher("AutoencoderKLMiniMaxH3", ("taeh3",), pixels="imagenet", model="MiniMax H3"),
}


@dataclass(frozen=True)
class TeacherFacts:
    """What a reference VAE's config says about its latent space."""

    latent_channels: int
    spatial_compression: int
    temporal_compression: int
    h3_chunks: bool = False

    def fits(self, spec: VariantSpec) -> bool:
        """``spec`` lives in this latent space: same channels, compression and time axis."""
        return (spec.latent_channels, 8 * spec.patch_size, spec.t_downscale, spec.h3_chunks) == (
            self.latent_channels, self.spatial_compression, self.temporal_compression, self.h3_chunks)

    def describe(self) -> str:
        return (f"{self.latent_channels} latent channels, {self.spatial_compression}x space, "
                f"{self.temporal_compression}x time" + (", 17-frame chunks" if self.h3_chunks else ""))


def read_vae_config(folder: Path) -> dict:
    """The ``config.json`` of a diffusers model folder; ValueError naming the folder when it
    is missing or not JSON."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder} is not a diffusers model folder (no config.json)")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON ({err})") from None


def _ratio(config: dict, key: str, derived: int) -> int:
    """A compression ratio from the config when it says, else derived from the blocks (LTX
    leaves ``None`` there when its blocks give the ratio)."""
    return int(config[key]) if config.get(key) else derived


def teacher_facts(ref_vae_class: str, config: dict) -> TeacherFacts:
    """Latent channels and compression of a VAE of class ``ref_vae_class`` from its config,
    the way the diffusers class itself derives them (docs/teachers.md)."""
    if ref_vae_class == "cogvideox":  # no spatial key: one 2x downsample between blocks
        return TeacherFacts(config["latent_channels"], 2 ** (len(config["block_out_channels"]) - 1),
                            int(config.get("temporal_compression_ratio") or 4))
    if ref_vae_class in ("hunyuan", "hunyuan15"):
        return TeacherFacts(config["latent_channels"], int(config["spatial_compression_ratio"]),
                            int(config["temporal_compression_ratio"]))
    if ref_vae_class == "wan":  # the scale_factor_* keys are labels; the blocks decide
        spatial = 2 ** (len(config["dim_mult"]) - 1) * (config.get("patch_size") or 1)
        return TeacherFacts(config["z_dim"], spatial, 2 ** sum(config.get("temperal_downsample", [False, True, True])))
    if ref_vae_class in ("ltx", "ltx2"):
        scaling = sum(config["spatio_temporal_scaling"])
        return TeacherFacts(config["latent_channels"],
                            _ratio(config, "spatial_compression_ratio", config["patch_size"] * 2 ** scaling),
                            _ratio(config, "temporal_compression_ratio", config["patch_size_t"] * 2 ** scaling))
    if ref_vae_class == "h3":
        return TeacherFacts(config["latent_channels"], math.prod(config["spatial_downsample_factors"]),
                            math.prod(config["temporal_downsample_factors"]), h3_chunks=True)
    raise ValueError(f"ref_vae_class must be one of {', '.join(TEACHERS)}, got {ref_vae_class!r}")


def variants_for(ref_vae_class: str, facts: TeacherFacts) -> list[str]:
    """TAE variants that live in this latent space, the teacher's own first."""
    own = [name for name in TEACHERS[ref_vae_class].variants if facts.fits(get_variant(name))]
    return own + [name for name in known_variants() if name not in own and facts.fits(get_variant(name))]


def teacher_problems(ref_vae_class: str, folder: Path, variant: str) -> list[str]:
    """What makes the VAE in ``folder`` unfit to teach ``variant`` ("auto": any of its own),
    each with what to change."""
    try:
        config = read_vae_config(folder)
    except ValueError as err:
        return [f"ref_vae_path: {err}: point ref_vae_path at a local copy of the video model, whose VAE "
                "subfolder (ref_vae_subfolder) holds it"]
    found, teacher = config.get("_class_name"), TEACHERS[ref_vae_class]
    if found != teacher.diffusers_class:
        matching = [name for name, t in TEACHERS.items() if t.diffusers_class == found]
        return [f"{folder / 'config.json'} holds a {found}, but ref_vae_class={ref_vae_class} loads "
                f"{teacher.diffusers_class}" + (f": set ref_vae_class={matching[0]}" if matching else "")]
    facts = teacher_facts(ref_vae_class, config)
    fitting = variants_for(ref_vae_class, facts)
    if variant == "auto":
        return [] if fitting else [f"no TAE variant fits the reference VAE ({facts.describe()})"]
    if facts.fits(get_variant(variant)):
        return []
    spec = get_variant(variant)
    return [f"the reference VAE has {facts.describe()} but {variant} has {spec.latent_channels} latent channels, "
            f"{8 * spec.patch_size}x space, {spec.t_downscale}x time" + (", 17-frame chunks" if spec.h3_chunks else "")
            + (f": pick the matching variant ({', '.join(fitting)})" if fitting else ": no TAE variant fits it")]


def auto_variant(ref_vae_class: str, folder: Path) -> str | None:
    """The TAE variant ``variant="auto"`` means for the VAE in ``folder``; None when the
    folder or its class cannot tell (the config check then says why)."""
    try:
        config = read_vae_config(folder)
    except ValueError:
        return None
    if ref_vae_class not in TEACHERS or config.get("_class_name") != TEACHERS[ref_vae_class].diffusers_class:
        return None
    fitting = variants_for(ref_vae_class, teacher_facts(ref_vae_class, config))
    return fitting[0] if fitting else None
