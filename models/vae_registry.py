"""The registry of reference VAE classes a TAE lives next to: what a diffusers video VAE's
``config.json`` says about its latent space, checked against the table of classes and their
TAEs (``models.vae_classes.REF_VAE_CLASSES``; loading and running one is
``common.reference_vae``).

Everything here is read from the model folder's ``config.json`` alone (no weights are
loaded, and the file is read once per process), so a config check can judge a reference
VAE before anything starts: its diffusers class, latent channels, spatial and temporal
compression (hence the frame rule), and which TAE variants fit its latent space. For a
published TAE whose reference VAE diffusers cannot load (taeos1_3), what no config says is
``models.unloaded_references``.

Which latents a TAE works on (raw, scaled, normalised) is its latent space
(``models.latent_spaces``): ``tae_space`` reads it from the published table, else from the
space the class's pipeline hands its transformer (``RefVAEClass.pipeline_space``).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from .downloads import fetch_hint
from .frames import H3_CHUNK_FRAMES
from .latent_spaces import (
    AUTO_SPACE,
    OWN,
    RAW,
    SPACES,
    LatentTransform,
    published_space,
    transform_for,
)
from .unloaded_references import UNLOADED_REFERENCES, published_transform
from .vae_classes import REF_VAE_CLASSES, FrameRule
from .variants import SUPER_SUFFIX, VariantSpec, built_family, built_name, get_variant, known_variants
from .weights import FORMAT_NAME

AUTO_CLASS = "auto"  # ref_vae_class read from the folder's config.json (its _class_name)


def resolve_ref_vae_class(ref_vae_class: str, folder: Path) -> str:
    """``ref_vae_class``, or for "auto" the one whose diffusers class the folder's
    ``config.json`` names; ValueError saying why it cannot be told."""
    if ref_vae_class != AUTO_CLASS:
        return ref_vae_class
    found = read_vae_config(folder).get("_class_name")
    for name, ref in REF_VAE_CLASSES.items():
        if ref.diffusers_class == found:
            return name
    raise ValueError(
        f"{Path(folder) / 'config.json'} holds a {found or 'model without _class_name'}, which no "
        f"ref_vae_class loads yet (known: {', '.join(ref.diffusers_class for ref in REF_VAE_CLASSES.values())})"
    )


def ref_vae_class_of(variant: str) -> str | None:
    """The ``ref_vae_class`` whose latent space ``variant`` (a super decoder too) lives in;
    None for a TAE whose reference VAE diffusers does not have (taeos1_3)."""
    base = built_family(variant) or variant.removesuffix(SUPER_SUFFIX)
    return next((name for name, ref in REF_VAE_CLASSES.items() if base in ref.variants), None)


def video_model(variant: str) -> str | None:
    """The video model whose latent space ``variant`` lives in, for model cards and messages."""
    name = ref_vae_class_of(variant)
    if name is None:
        unloaded = UNLOADED_REFERENCES.get(variant.removesuffix(SUPER_SUFFIX))
        return unloaded.video_model if unloaded else None
    return REF_VAE_CLASSES[name].variants[built_family(variant) or variant.removesuffix(SUPER_SUFFIX)]


@dataclass(frozen=True)
class LatentSpace:
    """What a reference VAE's config says about its latent space."""

    latent_channels: int
    spatial_compression: int
    temporal_compression: int
    h3_chunks: bool = False
    image_channels: int = 3
    causal: bool = True

    def fits(self, spec: VariantSpec) -> bool:
        """``spec`` lives in this latent space: same channels, compression, time axis and pixels."""
        return (
            spec.latent_channels,
            8 * spec.patch_size,
            spec.t_downscale,
            spec.h3_chunks,
            spec.image_channels,
            spec.causal,
        ) == (
            self.latent_channels,
            self.spatial_compression,
            self.temporal_compression,
            self.h3_chunks,
            self.image_channels,
            self.causal,
        )

    def describe(self) -> str:
        return (
            f"{self.latent_channels} latent channels, {self.spatial_compression}x space, "
            f"{self.temporal_compression}x time"
            + (", 17-frame chunks" if self.h3_chunks else "")
            + ("" if self.causal else ", not causal")
            + (", RGBA" if self.image_channels == 4 else "")
        )


@functools.cache
def _config_text(config_file: Path, mtime_ns: int, size: int) -> str:
    return config_file.read_text()  # once per process and file version (the stat keys the cache)


def read_vae_config(folder: Path) -> dict:
    """The ``config.json`` of a diffusers model folder (read once per process); ValueError
    naming the folder when it is missing, not JSON, or JSON other than an object."""
    config_file = Path(folder).resolve() / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder} is not a diffusers model folder (no config.json)")
    stat = config_file.stat()
    try:
        config = json.loads(_config_text(config_file, stat.st_mtime_ns, stat.st_size))
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON ({err})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{config_file} is not a text file ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ValueError(f"cannot read {config_file} ({err.strerror or err}): check its permissions") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} is not a diffusers config (a JSON object); it holds {_json_kind(config)}")
    return config


def _json_kind(value: object) -> str:
    """What a JSON value is, for messages: "a list", "a string", "null", ..."""
    if value is None:
        return "null"
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list"}
    return kinds.get(type(value), type(value).__name__)


def _ratio(config: dict, key: str, derived: int) -> int:
    """A compression ratio from the config when it says, else derived from the blocks (LTX
    leaves ``None`` there when its blocks give the ratio)."""
    return int(config[key]) if config.get(key) else derived


def latent_space(ref_vae_class: str, config: dict) -> LatentSpace:
    """Latent channels and compression of a VAE of class ``ref_vae_class`` from its config,
    the way the diffusers class itself derives them (docs/reference_vaes.md)."""
    if ref_vae_class == "cogvideox":  # no spatial key: one 2x downsample between blocks
        return LatentSpace(
            config["latent_channels"],
            2 ** (len(config["block_out_channels"]) - 1),
            int(config.get("temporal_compression_ratio") or 4),
        )
    if ref_vae_class in ("hunyuan", "hunyuan15"):
        return LatentSpace(
            config["latent_channels"],
            int(config["spatial_compression_ratio"]),
            int(config["temporal_compression_ratio"]),
        )
    if ref_vae_class == "wan":  # the scale_factor_* keys are labels; the blocks decide
        spatial = 2 ** (len(config["dim_mult"]) - 1) * (config.get("patch_size") or 1)
        return LatentSpace(config["z_dim"], spatial, 2 ** sum(config.get("temperal_downsample", [False, True, True])))
    if ref_vae_class in ("ltx", "ltx2"):
        scaling = sum(config["spatio_temporal_scaling"])
        return LatentSpace(
            config["latent_channels"],
            _ratio(config, "spatial_compression_ratio", config["patch_size"] * 2**scaling),
            _ratio(config, "temporal_compression_ratio", config["patch_size_t"] * 2**scaling),
        )
    if ref_vae_class == "h3":
        return LatentSpace(
            config["latent_channels"],
            math.prod(config["spatial_downsample_factors"]),
            math.prod(config["temporal_downsample_factors"]),
            h3_chunks=True,
        )
    if ref_vae_class == "allegro":  # one 2x downsample between blocks; its tiles use the time ratio
        return LatentSpace(
            config["latent_channels"],
            2 ** (len(config["block_out_channels"]) - 1),
            int(config["temporal_compression_ratio"]),
            causal=False,
        )
    if ref_vae_class == "easyanimate":  # the ratios the class itself derives from its blocks
        levels = len(config["block_out_channels"])
        return LatentSpace(config["latent_channels"], 2 ** (levels - 1), 2 ** (levels - 2))
    if ref_vae_class == "svd":  # a 2-D encoder
        return LatentSpace(config["latent_channels"], 2 ** (len(config["block_out_channels"]) - 1), 1)
    if ref_vae_class == "cosmos":
        return LatentSpace(
            config["latent_channels"],
            int(config["spatial_compression_ratio"]),
            int(config["temporal_compression_ratio"]),
        )
    if ref_vae_class == "kvae":
        return LatentSpace(
            config["z_channels"], 2 ** (len(config["ch_mult"]) - 1), int(config["temporal_compress_times"])
        )
    if ref_vae_class == "vidtok":  # None: the class's defaults, range(levels - 1) and [levels - 2, levels - 3]
        levels = len(config["ch_mult"])
        spatial, temporal = (
            config.get("spatial_ds") or range(levels - 1),
            config.get("tempo_ds") or [levels - 2, levels - 3],
        )
        return LatentSpace(config["z_channels"], 2 ** len(spatial), 2 ** len(temporal))
    if ref_vae_class == "mochi":
        return LatentSpace(
            config["latent_channels"], math.prod(config["spatial_expansions"]), math.prod(config["temporal_expansions"])
        )
    if ref_vae_class == "hunyuanimage_refiner":  # measured: its "temporal" stages keep every frame (1x time),
        # and every frame reaches every latent (not causal)
        return LatentSpace(config["latent_channels"], int(config["spatial_compression_ratio"]), 1, causal=False)
    if ref_vae_class == "qwenimage21":  # scale_factor_* are labels; it encodes single images
        return LatentSpace(config["z_dim"], 2 ** (len(config["dim_mult"]) - 1), 1, image_channels=config["in_channels"])
    raise ValueError(f"ref_vae_class must be one of {', '.join(REF_VAE_CLASSES)}, got {ref_vae_class!r}")


def variants_for(ref_vae_class: str, space: LatentSpace) -> list[str]:
    """TAE variants that live in this latent space, the reference VAE's own first: for a class
    with no published TAE, the one built for this configuration of it (``built_name``).
    ValueError when the TAE structure cannot express the latent space."""
    ref = REF_VAE_CLASSES[ref_vae_class]
    own = [name for name in ref.variants if space.fits(get_variant(name))]
    if not own and ref.family:
        built = built_name(ref.family, space.latent_channels, space.spatial_compression, space.temporal_compression)
        own = [built] if space.fits(get_variant(built)) else []
    return own + [name for name in known_variants() if name not in own and space.fits(get_variant(name))]


def ref_vae_problems(ref_vae_class: str, folder: Path, variant: str) -> list[str]:
    """What makes the VAE in ``folder`` unfit to teach ``variant`` ("auto": any of its own),
    each with what to change."""
    try:
        config = read_vae_config(folder)
    except ValueError as err:
        missing = "" if (folder / "config.json").is_file() else fetch_hint(folder.parent, folder.name)
        return [
            f"ref_vae_path: {err}: point ref_vae_path at a local copy of the video model, whose VAE "
            f"subfolder (ref_vae_subfolder) holds it{missing}"
        ]
    try:
        ref_vae_class = resolve_ref_vae_class(ref_vae_class, folder)
    except ValueError as err:
        return [f"ref_vae_class=auto: {err}"]
    found, ref = config.get("_class_name"), REF_VAE_CLASSES[ref_vae_class]
    if found != ref.diffusers_class:
        matching = [name for name, r in REF_VAE_CLASSES.items() if r.diffusers_class == found]
        return [
            f"{folder / 'config.json'} holds a {found}, but ref_vae_class={ref_vae_class} loads "
            f"{ref.diffusers_class}" + (f": set ref_vae_class={matching[0]}" if matching else "")
        ]
    if ref.refused:
        return [f"{folder / 'config.json'} holds a {found}: {ref.refused}"]
    try:
        space = latent_space(ref_vae_class, config)
    except KeyError as err:
        return [
            f"{folder / 'config.json'} has no {err.args[0]!r}, which an {ref.diffusers_class} config needs to tell "
            "its latent space: is the file complete?"
        ]
    except (TypeError, ValueError) as err:  # a value of the wrong kind: a number where a list belongs, ...
        return [
            f"{folder / 'config.json'}: a value there is of the wrong kind for an {ref.diffusers_class} config "
            f"({err}): is the file complete and from this model?"
        ]
    if ref_vae_class == "vidtok" and (config.get("regularizer") != "kl" or not config.get("is_causal")):
        return [
            f"{folder / 'config.json'}: only the causal VidTok with the KL regularizer has continuous latents in "
            f"TAE frames (this one: regularizer {config.get('regularizer')!r}, is_causal {config.get('is_causal')})"
        ]
    try:
        fitting = variants_for(ref_vae_class, space)
    except ValueError as err:  # a latent space the TAE structure cannot express
        return [
            f"{folder / 'config.json'}: no TAE can be built for this {ref.diffusers_class} ({space.describe()}): {err}"
        ]
    if variant == "auto":
        return [] if fitting else [f"no TAE variant fits the reference VAE ({space.describe()})"]
    if space.fits(get_variant(variant)):
        return []
    spec = get_variant(variant)
    return [
        f"the reference VAE has {space.describe()} but {variant} has {spec.latent_channels} latent channels, "
        f"{8 * spec.patch_size}x space, {spec.t_downscale}x time"
        + (", 17-frame chunks" if spec.h3_chunks else "")
        + (f": pick the matching variant ({', '.join(fitting)})" if fitting else ": no TAE variant fits it")
    ]


def auto_variant(ref_vae_class: str, folder: Path) -> str | None:
    """The TAE variant ``variant="auto"`` means for the VAE in ``folder``; None when the
    folder or its class cannot tell (the config check then says why)."""
    try:
        config = read_vae_config(folder)
        ref_vae_class = resolve_ref_vae_class(ref_vae_class, folder)
    except ValueError:
        return None
    if (
        ref_vae_class not in REF_VAE_CLASSES
        or config.get("_class_name") != REF_VAE_CLASSES[ref_vae_class].diffusers_class
    ):
        return None
    try:
        fitting = variants_for(ref_vae_class, latent_space(ref_vae_class, config))
    except (KeyError, ValueError):  # ref_vae_problems names the missing key or what the TAE cannot express
        return None
    return fitting[0] if fitting else None


def _own_frame_rule(spec: VariantSpec) -> FrameRule | None:
    name = ref_vae_class_of(spec.name)
    return REF_VAE_CLASSES[name].frame_rule if name else None


def reference_vae_frames(n_frames: int, spec: VariantSpec) -> bool:
    """Whether the reference VAE of ``spec`` takes ``n_frames`` frames: ``t_downscale * k + 1``
    (k >= 1) encode to k+1 latents (4k+1 for most, 6k+1 for Mochi, 8k+1 for LTX and Cosmos);
    without temporal compression any count; MiniMax H3 pads clips to 17-frame chunks and
    decodes only more than 17 frames (docs/h3_alignment.md); some classes have a rule of
    their own (``RefVAEClass.frame_rule``)."""
    if (rule := _own_frame_rule(spec)) is not None:
        return rule.takes(n_frames)
    if spec.h3_chunks:
        return n_frames > H3_CHUNK_FRAMES
    if spec.t_downscale == 1:
        return n_frames >= 1
    return n_frames > 1 and (n_frames - 1) % spec.t_downscale == 0


def reference_vae_rule(spec: VariantSpec) -> str:
    if (rule := _own_frame_rule(spec)) is not None:
        return rule.says
    if spec.h3_chunks:
        return (
            f"pads clips to {H3_CHUNK_FRAMES}-frame chunks and decodes only clips of more than {H3_CHUNK_FRAMES} frames"
        )
    if spec.t_downscale == 1:
        return "keeps every frame (no temporal compression)"
    return f"encodes {spec.t_downscale}k+1 frames to k+1 latents"


def tae_space(variant: str, ref_vae_class: str | None) -> str:
    """The latent space ``variant`` lives in next to a VAE of ``ref_vae_class`` (None: a plain
    autoencoder, a space of its own): a published TAE's from the table
    (``models.latent_spaces.TAE_SPACES``), a built one's (or a custom one's) from the space
    the class's pipeline hands its transformer."""
    if ref_vae_class is None:
        return OWN
    row = published_space(variant)
    return row.space if row else REF_VAE_CLASSES[ref_vae_class].pipeline_space


def resolve_space(latent_space: str, variant: str, ref_vae_class: str | None) -> str:
    """The config key ``latent_space``: "auto" is ``tae_space``, anything else stays."""
    return tae_space(variant, ref_vae_class) if latent_space == AUTO_SPACE else latent_space


def reference_transform(space: str, ref_vae_class: str, config: dict, module: object | None = None) -> LatentTransform:
    """The map from the raw latents of a VAE of ``ref_vae_class`` (its ``config``, and the
    module holding LTX's statistics) into ``space``; ValueError naming what it lacks."""
    return transform_for(space, config, module, REF_VAE_CLASSES[ref_vae_class].sampler_scale)


OWN_SUFFIX = "_own_latents"  # the export's name for a TAE with a latent space of its own


def file_space(
    variant: str, metadata: dict[str, str] | None, stem: str = "", run_config: dict | None = None
) -> tuple[str | None, LatentTransform | None]:
    """The latent space of a weight file (and the reference statistics it was trained with):
    what its metadata says; a file of ours from before spaces were recorded holds raw
    latents; a file without metadata whose name (``stem``) ends in ``OWN_SUFFIX`` its own
    space; one whose run's saved config (``run_config``) is at hand the run's (its own
    without a reference VAE); a published file the table's space (with its statistics where
    diffusers cannot load its VAE: ``published_transform``), a built variant's its
    pipeline's; None for a custom architecture nobody described."""
    if metadata and metadata.get("format") == FORMAT_NAME:
        recorded, space = metadata.get("latent_transform"), metadata.get("latent_space", RAW)
        return (None if space == "unknown" else space), LatentTransform.from_json(recorded) if recorded else None
    if stem.endswith(OWN_SUFFIX) or (run_config is not None and not run_config.get("ref_vae_path")):
        return OWN, None
    if run_config is not None and run_config.get("latent_space") in SPACES:
        return run_config["latent_space"], None
    row = published_space(variant)
    if row:
        return row.space, published_transform(variant)
    ref_vae_class = ref_vae_class_of(variant)
    return (REF_VAE_CLASSES[ref_vae_class].pipeline_space if ref_vae_class else None), None


def class_defaults(ref_vae_class: str) -> dict:
    """The config a diffusers class takes when nothing is given: the released model's
    statistics for most (Wan 2.1's latents_mean/std, HunyuanVideo's scaling_factor, ...)."""
    import inspect

    import diffusers

    cls = getattr(diffusers, REF_VAE_CLASSES[ref_vae_class].diffusers_class)
    return {
        k: p.default
        for k, p in inspect.signature(cls.__init__).parameters.items()
        if k != "self" and p.default is not inspect.Parameter.empty
    }


def spaces_of(ref_vae_class: str, config: dict, module: object | None = None) -> dict[str, LatentTransform]:
    """Every space the statistics of a VAE of ``ref_vae_class`` define, the one its pipeline
    hands the transformer first (``models.latent_spaces.guess_space`` takes that one as the
    diffusion model's)."""
    found = {}
    for space in dict.fromkeys((REF_VAE_CLASSES[ref_vae_class].pipeline_space, *SPACES)):
        try:
            found[space] = reference_transform(space, ref_vae_class, config, module)
        except ValueError:  # a space whose statistics this VAE lacks is no candidate
            continue
    return found
