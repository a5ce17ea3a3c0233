"""Which latents each TAE encodes to and decodes from: its latent space.

A reference VAE's ``encode(x).latent_dist`` gives *raw* latents. Diffusion models work on
them *scaled* by the VAE's ``scaling_factor``, *normalised* per channel by its
``latents_mean``/``latents_std``, or both, and a TAE lives in one of these spaces: the one
its published weights were trained in, which is what its author's demos, ComfyUI and
LightX2V hand it (``TAE_SPACES``, with the evidence for each row; docs/reference_vaes.md,
"Which latents go in"). A TAE built here for a VAE with no published TAE takes the space
its pipeline's transformer uses (``RefVAEClass.pipeline_space``), so that a diffusers live preview
decodes sampler latents as they are; one trained without a reference VAE has a space of
its own (``OWN``).

Every space is one affine map of the raw latents, per channel (per channel and latent
frame for Cosmos): ``z = (raw - mean) / std * scale`` (``LatentTransform``). Training, the
latent cache, validation, ``inference.py --use_ref_vae`` (all through
``common.reference_vae.ReferenceVAE``) and the diffusers wrapper convert with it, and
``guess_space`` says which space a latent tensor looks like.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from .variants import SUPER_SUFFIX

RAW, SCALED, NORMALISED, NORMALISED_SCALED, OWN = "raw", "scaled", "normalised", "normalised_scaled", "own"
SPACES = (RAW, SCALED, NORMALISED, NORMALISED_SCALED)  # the spaces of a reference VAE's latents
AUTO_SPACE = "auto"  # the config key's default: the table's space for the variant and reference VAE
SPACE_FORMULAS = {
    RAW: "raw latents, as vae.encode(x).latent_dist gives them",
    SCALED: "raw * scaling_factor",
    NORMALISED: "(raw - latents_mean) / latents_std",
    NORMALISED_SCALED: "(raw - latents_mean) / latents_std * scaling_factor",
    OWN: "its own: trained without a reference VAE",
}


@dataclass(frozen=True)
class SpaceRow:
    """The space a published TAE's weights live in, and why we think so."""

    space: str
    evidence: str
    certainty: str  # "shown": its author's code or files show it; "loaders": read from the loaders that use it;
    # "stated": only the author's general statement ("exactly what diffusion models use") and the pipeline


_README = (
    "madebyollin/taehv README: 'TAEHV encodes / decodes exactly what diffusion models use'; the "
    "diffusers pipeline's transformer latents are "
)
# Published weights -> their space (super decoders share their base's row). Read from the files
# cited; docs/reference_vaes.md has the same table with the quotes.
TAE_SPACES = {
    "taecvx": SpaceRow(
        RAW,
        "madebyollin/taehv examples/TAECVX_T2I_Demo.ipynb: CogVideoX 1.5's pipeline latents are multiplied "
        "by 1 / 0.7 ('needed to invert the scaling factor that 1.5 bakes in') before TAECVX decodes them",
        "shown",
    ),
    "taehv": SpaceRow(
        SCALED,
        "ComfyUI comfy/sd.py (the 'decoder.22.bias' branch): a 16-channel fp16 TAE gets "
        "latent_format=HunyuanVideo, whose process_in multiplies by scale_factor 0.476986 before decoding",
        "loaders",
    ),
    "taew2_1": SpaceRow(
        NORMALISED,
        "madebyollin/taehv examples/TAEW2.1_T2I_Demo.ipynb gives WanPipeline latents_mean=0, latents_std=1; "
        "examples/test_latents_wan.pth has per-channel std 0.61-1.2 (raw Wan 2.1: 1.1-3.3); LightX2V "
        "vae_tiny.py un-normalises only for its own lighttae weights (need_scaled)",
        "shown",
    ),
    "taew2_2": SpaceRow(
        NORMALISED,
        "madebyollin/taehv examples/TAEW2.2_T2I_Demo.ipynb gives WanPipeline latents_mean=0, latents_std=1",
        "shown",
    ),
    "taehv1_5": SpaceRow(
        SCALED,
        "blepping/ComfyUI-bleh py/better_previews/base.py VIDEO_FORMATS (hunyuanvideo15: taehv1_5.pth with "
        "latent_formats.HunyuanVideo15) and py/nodes/taevid.py TAEVidDecode (latent_format().process_in(samples) "
        "before decode: raw * scale_factor 1.03682, comfy/latent_formats.py class HunyuanVideo15); its previews "
        "hand the sampler's x0, which ComfyUI keeps in process_in's space (comfy/samplers.py, process_latent_in "
        "before sampling, process_latent_out after)",
        "loaders",
    ),
    "taeos1_3": SpaceRow(
        NORMALISED,
        "madebyollin/taehv README: 'TAEHV encodes / decodes exactly what diffusion models use'; Open-Sora 1.3's "
        "DiT gets (z - mean) / std: hpcaitech/Open-Sora tag v1.3 opensora/models/vae_v1_3/vae.py normalize_z "
        "(lines 118-125) with constants.py VAE_STAT_DICT['video'] (lines 176-213), as "
        "configs/opensora-v1-3/inference/t2v.py sets normalization='video' (line 32)",
        "stated",
    ),
    "taeh3": SpaceRow(
        NORMALISED,
        _README + "(raw - latents_mean) / latents_std (diffusers modular_pipelines/minimax_h3/decoders.py:188 "
        "computes latents * latents_std + latents_mean before decoding)",
        "stated",
    ),
    "taeltx_2": SpaceRow(
        NORMALISED,
        "madebyollin/taehv examples/TAELTX2_Encoding_Decoding_Demo.ipynb: the reference wrapper encodes "
        "(latent - latents_mean) / latents_std and decodes x * latents_std + latents_mean (scaling_factor 1.0)",
        "shown",
    ),
    "taeltx2_3": SpaceRow(
        NORMALISED,
        "blepping/ComfyUI-bleh py/better_previews/base.py VIDEO_FORMATS (ltxav23: taeltx2_3.pth, TAEVidLTX2, "
        "latent_formats.LTXV, whose process_in multiplies by 1.0) and py/nodes/taevid.py TAEVidDecode hand it "
        "ComfyUI's LTX latents, which its LTX VAE normalises: comfy/ldm/lightricks/vae/causal_video_autoencoder.py "
        "VideoVAE.encode returns per_channel_statistics.normalize(means), (means - mean-of-means) / std-of-means",
        "loaders",
    ),
    "taeltx2_3_wide": SpaceRow(
        NORMALISED,
        "as taeltx2_3: blepping/ComfyUI-bleh py/better_previews/base.py VIDEO_FORMATS (ltxav23wide: "
        "taeltx2_3_wide.pth, TAEVidLTX23Wide, latent_formats.LTXV)",
        "loaders",
    ),
    "lighttaew2_1": SpaceRow(
        RAW,
        "LightX2V lightx2v/models/video_encoders/hf/wan/vae_tiny.py: need_scaled (set for 'lighttae' paths in "
        "lightx2v/pipeline.py) computes latents * latents_std + latents_mean first; sglang's LightTAEDecoder "
        "and ComfyUI (16 channels, not fp16: latent_format=None on raw latents) agree",
        "loaders",
    ),
    "lighttaew2_2": SpaceRow(RAW, "as lighttaew2_1 (LightX2V's Wan2_2_VAE_tiny, need_scaled)", "loaders"),
    "lighttaehy1_5": SpaceRow(
        RAW,
        "LightX2V hunyuanvideo15/lighttae_hy15.py divides by scaling_factor 1.03682 before decoding; ComfyUI "
        "(32 channels, 12 outputs: latent_format=HunyuanVideo15) feeds raw * 1.03682 instead, 1.075x apart",
        "loaders",
    ),
}


def published_space(variant: str) -> SpaceRow | None:
    """The table's row for a published variant (a super decoder: its base's), else None."""
    return TAE_SPACES.get(variant) or TAE_SPACES.get(variant.removesuffix(SUPER_SUFFIX))


@dataclass(frozen=True)
class LatentTransform:
    """``z = (raw - mean) / std * scale``: the map from a reference VAE's raw latents into a
    TAE's space. ``mean``/``std`` hold one value per channel, or (Cosmos) ``frames`` values per
    channel, channel-major, as the VAE's config lists them; None: 0 and 1."""

    space: str
    scale: float = 1.0
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def _stats(self, z: torch.Tensor) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """``mean`` and ``std`` shaped for NTCHW ``z``, on its device, float32."""
        channels, frames = z.shape[2], z.shape[1]

        def shaped(values: tuple[float, ...] | None, default: float) -> torch.Tensor | float:
            if values is None:
                return default
            if len(values) % channels:
                raise ValueError(
                    f"{self.space} latents: the VAE's statistics hold {len(values)} values, which is no "
                    f"multiple of the {channels} latent channels"
                )
            stats = torch.tensor(values, dtype=torch.float32, device=z.device).view(channels, -1)
            if stats.shape[1] > 1:  # per latent frame (Cosmos), sliced as its pipeline does
                if stats.shape[1] < frames:
                    raise ValueError(
                        f"{self.space} latents: the VAE's statistics cover {stats.shape[1]} latent frames, "
                        f"this clip has {frames}"
                    )
                return stats[:, :frames].T.reshape(1, frames, channels, 1, 1)
            return stats.view(1, 1, channels, 1, 1)

        return shaped(self.mean, 0.0), shaped(self.std, 1.0)

    def to_tae(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw NTCHW latents -> this space (float32)."""
        if self.is_identity:
            return raw.float()
        mean, std = self._stats(raw)
        return (raw.float() - mean) / std * self.scale

    def to_raw(self, z: torch.Tensor) -> torch.Tensor:
        """NTCHW latents of this space -> raw (float32)."""
        if self.is_identity:
            return z.float()
        mean, std = self._stats(z)
        return z.float() / self.scale * std + mean

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.mean is None and self.std is None

    def describe(self) -> str:
        """The space in words, for logs and messages: ``normalised ((raw - latents_mean) / latents_std)``."""
        scale = f", scale {self.scale:g}" if self.space in (SCALED, NORMALISED_SCALED) else ""
        return f"{self.space} latents ({SPACE_FORMULAS[self.space]}{scale})"

    def to_json(self) -> str:
        return json.dumps({"space": self.space, "scale": self.scale, "mean": self.mean, "std": self.std})

    @classmethod
    def from_json(cls, text: str) -> LatentTransform:
        value = json.loads(text)
        return cls(value["space"], float(value["scale"]), _floats(value["mean"]), _floats(value["std"]))


def _floats(value: object) -> tuple[float, ...] | None:
    """A config list or tensor of statistics as a tuple, None when absent."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return tuple(float(v) for v in value.detach().float().flatten().tolist())
    return tuple(float(v) for v in value)


def transform_for(
    space: str, config: dict, module: torch.nn.Module | None = None, sampler_scale: float | None = None
) -> LatentTransform:
    """The map into ``space`` for the VAE whose ``config`` (and, for LTX, whose ``module``'s
    ``latents_mean``/``latents_std`` buffers) hold the statistics; ``sampler_scale`` replaces
    ``scaling_factor`` where the pipeline scales by something else (Cosmos: its scheduler's
    ``sigma_data``). ValueError naming what the VAE lacks for that space."""
    if space in (RAW, OWN):
        return LatentTransform(space)
    scale = 1.0
    if space in (SCALED, NORMALISED_SCALED):
        scale = sampler_scale if sampler_scale is not None else config.get("scaling_factor")
        if scale is None:
            raise ValueError(f"{space} latents need the VAE's scaling_factor, which its config does not have")
    mean = std = None
    if space in (NORMALISED, NORMALISED_SCALED):
        buffers = dict(module.named_buffers()) if isinstance(module, torch.nn.Module) else {}
        mean, std = (_floats(buffers.get(key)) or _floats(config.get(key)) for key in ("latents_mean", "latents_std"))
        if mean is None or std is None:
            raise ValueError(
                f"{space} latents need the VAE's latents_mean and latents_std, which neither its config nor "
                "its weights hold"
            )
    return LatentTransform(space, float(scale), mean, std)


@dataclass(frozen=True)
class SpaceGuess:
    """Which space a latent tensor looks like, and how far each candidate is (0: per-channel
    mean and std exactly as expected)."""

    best: str | None  # None: two spaces fit about equally well, or none was given
    distances: dict[str, float]

    def describe(self) -> str:
        ranked = ", ".join(f"{space} {d:.2f}" for space, d in sorted(self.distances.items(), key=lambda kv: kv[1]))
        verdict = f"they look {self.best}" if self.best else "their space cannot be told from their statistics"
        return f"{verdict} (distance of the per-channel mean and std to each space's: {ranked})"


# the best space must be this much closer than the next: real latents stray from a space's ideal
# statistics by about this much (madebyollin's Wan test latents: 0.45 from normalised, 1.06 from raw)
MARGIN = 0.25
FARTHEST = 1.0  # farther from every space than this (a factor e in std), the latents look like none


def guess_space(latents: torch.Tensor, candidates: dict[str, LatentTransform]) -> SpaceGuess:
    """Which of ``candidates`` (spaces of one VAE) NTCHW ``latents`` look like, from their
    per-channel mean and std. A diffusion model's space is made to have mean ~0 and std ~1 per
    channel (that is what ``latents_mean``/``latents_std`` and ``scaling_factor`` are for), so
    each candidate's expected statistics are those of unit latents in the *first* candidate's
    space (the diffusion model's), mapped through raw into it. Spaces whose expected
    statistics differ by less than ``MARGIN`` (CogVideoX's raw and scaled: a factor 1.15)
    cannot be told apart, and latents farther than ``FARTHEST`` from all look like none."""
    if not candidates:
        return SpaceGuess(None, {})
    flat = latents.detach().float().transpose(0, 2).flatten(1)  # channels first
    mean, std = flat.mean(1), flat.std(1).clamp_min(1e-8)
    model_space = next(iter(candidates.values()))
    frames = latents.shape[1]
    unit = torch.zeros(1, frames, latents.shape[2], 1, 1)
    distances = {}
    for name, transform in candidates.items():
        zero = transform.to_tae(model_space.to_raw(unit))  # where the model space's 0 lands
        one = transform.to_tae(model_space.to_raw(unit + 1))  # and its 1: the slope is the std
        expected_mean, expected_std = zero.mean((0, 1)).flatten(), (one - zero).abs().mean((0, 1)).flatten()
        distances[name] = float(
            ((std / expected_std).log().square() + ((mean - expected_mean) / expected_std).square()).mean().sqrt()
        )
    ranked = sorted(distances.values())
    clear = (len(ranked) == 1 or ranked[1] - ranked[0] > MARGIN) and ranked[0] < FARTHEST
    best = min(distances, key=distances.get) if clear else None
    return SpaceGuess(best, distances)
