"""A TAE behind the interface diffusers video pipelines call: ``pipe.vae = TAEVideoVAE.from_file("taecvx.pth")``.

Pipelines hand the VAE NCTHW videos in [-1, 1] and read ``encode(x).latent_dist`` and
``decode(z).sample``; they scale or normalise latents around the diffusion model
themselves and undo it before ``decode`` (docs/reference_vaes.md), so ``decode`` gets raw
latents and ``encode`` must return raw ones. The wrapper converts between those and the
TAE's own space (``models.latent_spaces``: raw for TAECVX, the transformer's scaled or
normalised latents for most others), so the TAE decodes what its author's own wrapper hands
it, whatever the pipeline does before ``vae.decode``. What pipelines read from
``vae.config`` (scaling factor, compression ratios, ``latents_mean``/``latents_std``), and
the statistics of the conversion, come from the real VAE when it is given
(``like=pipe.vae``), else from the weight file (the statistics it was trained with), else
from the defaults of the reference VAE's diffusers class, with the compression set from the
TAE itself. Tiling and slicing are accepted and do nothing: a TAE
needs neither. Where the real class's own layout differs, the wrapper's follows it (keyed by
the TAE's reference VAE class): Allegro's ``decode`` gives NTCHW frames, and SVD's
(AutoencoderKLTemporalDecoder) encodes (N, 3, H, W) images and decodes (B*T, 4, h, w) frame
latents with ``num_frames=T``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from diffusers.configuration_utils import FrozenDict
from diffusers.models.autoencoders.vae import DecoderOutput
from diffusers.utils import BaseOutput

from .latent_spaces import NORMALISED_SCALED, OWN, SCALED, SPACES, LatentTransform, transform_for
from .taehv import TAEHV
from .unloaded_references import published_transform
from .vae_classes import REF_VAE_CLASSES
from .vae_registry import class_defaults, ref_vae_class_of, reference_transform, video_model

logger = logging.getLogger(__name__)


class TAELatents:
    """What ``encode(x).latent_dist`` offers pipelines; a TAE's encoder is deterministic."""

    def __init__(self, latents: torch.Tensor):
        self.latents = self.mean = latents

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.latents

    def mode(self) -> torch.Tensor:
        return self.latents


@dataclass
class TAEEncoderOutput(BaseOutput):
    latent_dist: TAELatents
    latents: torch.Tensor


def pipeline_config(tae: TAEHV, like: torch.nn.Module | None = None) -> dict:
    """The config pipelines read: the real VAE's (``like``), else its class defaults with the
    statistics the TAE was trained with (``tae.latent_transform``), with the TAE's latent
    channels and compression."""
    if like is not None:
        config = dict(like.config)
        channels = config.get("latent_channels", config.get("z_dim"))
        if channels is not None and channels != tae.latent_channels:
            raise ValueError(
                f"like= is a VAE with {channels} latent channels, but {tae.variant} has "
                f"{tae.latent_channels}: pass the pipeline's own VAE, whose latent space the TAE lives in"
            )
    else:
        ref_vae_class = ref_vae_class_of(tae.variant)
        if ref_vae_class is None:
            raise ValueError(f"no diffusers VAE class is known for {tae.variant}; pass like=<the pipeline's VAE>")
        recorded = tae.latent_transform
        if ref_vae_class in ("ltx", "ltx2") and (recorded is None or recorded.mean is None):
            raise ValueError(
                "LTX keeps its latents_mean/latents_std in the VAE's weights, not its config: pass "
                "like=<the pipeline's VAE> (TAEVideoVAE.from_file(path, like=pipe.vae))"
            )
        ref = REF_VAE_CLASSES[ref_vae_class]
        config = class_defaults(ref_vae_class)
        if recorded is not None:  # the statistics it was trained with, where the pipeline reads them
            if recorded.mean is not None:
                config.update(latents_mean=list(recorded.mean), latents_std=list(recorded.std))
            if recorded.space in (SCALED, NORMALISED_SCALED) and ref.sampler_scale is None:
                config["scaling_factor"] = recorded.scale
        mean = config.get("latents_mean")  # Cosmos's: one per channel and latent frame, channel-major
        if mean is not None and len(mean) % tae.latent_channels:
            raise ValueError(
                f"the default latents_mean of {ref.diffusers_class} has {len(mean)} channels, {tae.variant} "
                f"{tae.latent_channels}: pass like=<the pipeline's VAE> so its normalisation is used"
            )
    spatial = 8 * tae.patch_size
    config.update(
        latent_channels=tae.latent_channels,
        spatial_compression_ratio=spatial,
        temporal_compression_ratio=tae.t_downscale,
        scale_factor_spatial=spatial,
        scale_factor_temporal=tae.t_downscale,
    )
    if "z_dim" in config:
        config["z_dim"] = tae.latent_channels
    blocks = config.get("block_out_channels")  # Allegro's and SVD's pipelines read 2 ** (len - 1) as the spatial factor
    if blocks is not None and 2 ** (len(blocks) - 1) != spatial:  # SVD's class default is one block
        config["block_out_channels"] = (*blocks, *[blocks[-1]] * spatial.bit_length())[: spatial.bit_length()]
    return config


def wrapper_transform(
    tae: TAEHV, config: dict, like: torch.nn.Module | None = None, latent_space: str | None = None
) -> LatentTransform:
    """The map between the pipeline's raw latents and the TAE's space (``latent_space``
    overrides the one the weights carry). ValueError for a TAE whose space is its own or
    unknown unless ``latent_space`` says which to use, and for statistics ``config`` lacks."""
    space = latent_space or tae.latent_space
    if space == OWN or space is None:
        what = (
            "was trained without a reference VAE: its latents are its own"
            if space == OWN
            else "does not say which latents it works on (no metadata, no published name)"
        )
        raise ValueError(
            f"{tae.variant} {what}, so a pipeline's latents would decode wrongly; pass latent_space= one of "
            f"{', '.join(SPACES)} to use it as a TAE of {video_model(tae.variant) or 'the pipeline'}'s latents anyway"
        )
    if space not in SPACES:
        raise ValueError(f"latent_space must be one of {', '.join(SPACES)}, got {space!r}")
    recorded = tae.latent_transform
    ref_vae_class = ref_vae_class_of(tae.variant)
    # the statistics it was trained with; a like= VAE's replace them only where diffusers has its
    # reference VAE (taeos1_3's, Open-Sora 1.3's, is none: another VAE's statistics would be wrong)
    if recorded is not None and recorded.space == space and (like is None or published_transform(tae.variant)):
        return recorded
    if ref_vae_class is None:
        return transform_for(space, config, like)
    return reference_transform(space, ref_vae_class, config, like)


class TAEVideoVAE(torch.nn.Module):
    """A TAE with the methods and attributes a diffusers video pipeline uses on ``pipe.vae``."""

    def __init__(
        self,
        tae: TAEHV,
        config: dict,
        parallel: bool = True,
        like: torch.nn.Module | None = None,
        compile: bool = False,
        latent_space: str | None = None,
    ):
        """``tae`` behind the pipeline interface with ``config`` (``pipeline_config``);
        ``parallel=False`` encodes and decodes chunk by chunk (memory flat in the number of
        frames). ``compile=True`` calls ``tae.compile()`` (``torch.compile`` with inductor):
        the first encode and decode of each video shape pay the compilation.
        ``latent_space`` overrides the space the weights carry (``wrapper_transform``)."""
        super().__init__()
        self.tae, self.parallel = tae, parallel
        self.transform = wrapper_transform(tae, config, like, latent_space)
        logger.info("%s works on %s", tae.variant, self.transform.describe())
        ref = REF_VAE_CLASSES.get(ref_vae_class_of(tae.variant))
        self.images = bool(ref and ref.image_encoder)  # SVD: frame batches (its 2-D encoder, decode(z, num_frames))
        self.frames_first = bool(ref and ref.time_tiles)  # Allegro: decode gives NTCHW
        if compile:
            tae.compile()
            logger.info("torch.compile: the first encode and decode of each shape compile the %s blocks", tae.variant)
        self.config = FrozenDict(config)
        # LTX pipelines read these from the VAE object itself (latents_mean/std are buffers there)
        self.spatial_compression_ratio = config["spatial_compression_ratio"]
        self.temporal_compression_ratio = config["temporal_compression_ratio"]
        buffers = dict(like.named_buffers()) if like is not None else {}
        for name in ("latents_mean", "latents_std"):
            value = buffers.get(name)
            if like is None and ref_vae_class_of(tae.variant) in ("ltx", "ltx2"):  # the statistics it was trained with
                value = torch.tensor(getattr(tae.latent_transform, name.removeprefix("latents_")))
            if isinstance(value, torch.Tensor):
                self.register_buffer(name, value.detach().clone(), persistent=False)

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        variant: str | None = None,
        like: torch.nn.Module | None = None,
        parallel: bool = True,
        compile: bool = False,
        latent_space: str | None = None,
    ) -> TAEVideoVAE:
        """A published or trained TAE weight file (the variant and its latent space from its
        name or metadata), configured like ``like`` (the pipeline's own VAE) when given;
        ``compile=True`` torch.compiles it, ``latent_space`` overrides its space (see ``__init__``)."""
        tae = TAEHV(path, variant=variant).eval().requires_grad_(False)
        return cls(tae, pipeline_config(tae, like), parallel, like, compile, latent_space)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.tae.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.tae.parameters()).device

    @torch.no_grad()
    def encode(self, x: torch.Tensor, return_dict: bool = True) -> TAEEncoderOutput | tuple:
        """NCTHW video in [-1, 1] -> raw NCTHW latents; for SVD, (N, 3, H, W) images -> (N, 4, h, w)
        latents, each image a one-frame clip (its encoder is 2-D: images never mix)."""
        self._check_layout(x, "encode", f"{'images' if self.images else 'videos'} in [-1, 1]", self.tae.image_channels)
        frames = x.unsqueeze(1) if self.images else x.permute(0, 2, 1, 3, 4)  # NTCHW
        latents = self.tae.encode_video(frames.to(self.dtype).add(1).div(2), parallel=self.parallel)
        latents = self.transform.to_raw(latents).to(self.dtype)
        latents = latents.squeeze(1) if self.images else latents.permute(0, 2, 1, 3, 4)
        output = TAEEncoderOutput(latent_dist=TAELatents(latents), latents=latents)
        return output if return_dict else (output.latent_dist,)

    @torch.no_grad()
    def decode(
        self,
        z: torch.Tensor,
        temb: torch.Tensor | None = None,
        return_dict: bool = True,
        *,
        num_frames: int | None = None,
    ) -> DecoderOutput | tuple:
        """Raw NCTHW latents (what pipelines pass) -> NCTHW video in [-1, 1] (NTCHW for Allegro, as its class's);
        ``temb``, LTX's decode timestep, is accepted and not used: a TAE decodes the clean video.
        For SVD, (B*T, 4, h, w) frame latents -> (B*T, 3, H, W) frames, each ``num_frames``
        latents decoded as one clip (None: all of them)."""
        self._check_layout(z, "decode", "frame latents" if self.images else "latents", self.tae.latent_channels)
        z = z.unflatten(0, (-1, num_frames or z.shape[0])) if self.images else z.permute(0, 2, 1, 3, 4)  # NTCHW
        z = self.transform.to_tae(z).to(self.dtype)
        frames = self.tae.decode_video(z, parallel=self.parallel).mul(2).sub(1)
        video = frames.flatten(0, 1) if self.images else frames if self.frames_first else frames.permute(0, 2, 1, 3, 4)
        return DecoderOutput(sample=video) if return_dict else (video,)

    def _check_layout(self, x: torch.Tensor, method: str, what: str, channels: int) -> None:
        """ValueError for a tensor of another layout than ``method`` takes (NCTHW; NCHW frames
        for SVD), or with other than ``channels`` channels, showing the shape as passed."""
        layout = "NCHW" if self.images else "NCTHW"
        if x.ndim == len(layout) and x.shape[1] == channels:
            return
        hint = ""
        if not self.images and x.ndim == 5 and x.shape[2] == channels:
            hint = " (this looks like NTCHW: pass x.permute(0, 2, 1, 3, 4))"
        raise ValueError(
            f"{type(self).__name__}.{method} takes {layout} {what} with {channels} channels in dim 1 "
            f"({self.tae.variant}), got shape {tuple(x.shape)}{hint}"
        )

    def forward(
        self,
        sample: torch.Tensor,
        sample_posterior: bool = False,
        return_dict: bool = True,
        generator: torch.Generator | None = None,
        num_frames: int | None = None,
    ) -> DecoderOutput | tuple:
        """``sample`` encoded and decoded, as the diffusers VAEs' forward (SVD's pipeline reads
        ``num_frames`` from this signature to pass it to ``decode``)."""
        return self.decode(self.encode(sample).latents, return_dict=return_dict, num_frames=num_frames)

    def enable_tiling(self, *args, **kwargs) -> None:
        """Accepted for pipelines that call it; a TAE needs no tiling."""

    def disable_tiling(self) -> None:
        """Accepted for pipelines that call it."""

    def enable_slicing(self) -> None:
        """Accepted for pipelines that call it; a TAE needs no slicing."""

    def disable_slicing(self) -> None:
        """Accepted for pipelines that call it."""
