"""Live previews while a diffusers video pipeline samples: a TAE decodes each chosen step's
denoised estimate, as ComfyUI's previewer does with its samplers' ``x0`` (Comfy-Org/ComfyUI
latent_preview.py: ``prepare_callback`` hands it ``x0``; ``TAEHVPreviewerImpl.
decode_latent_to_preview`` decodes ``x0[:1, :, :1]``, the first sample's first latent frame).

``LivePreview`` is a ``callback_on_step_end``: ``pipe(..., callback_on_step_end=preview)``.
The pipelines call it after the scheduler's step with the new latents, which are in the
space the pipeline hands its transformer (``RefVAEClass.pipeline_space``: Wan normalised,
CogVideoX and HunyuanVideo scaled, LTX normalised and scaled, with the pipeline VAE's own
statistics). They go to raw latents and into the TAE's space through the one conversion
(``models.latent_spaces.LatentTransform``, as the diffusers wrapper does), and only the
first sample of the batch is decoded, optionally only its first latent frames.

The denoised estimate: ``FlowMatchEulerDiscreteScheduler.step`` (diffusers
schedulers/scheduling_flow_match_euler_discrete.py) moves ``x_i`` to ``x_{i+1} = x_i +
(sigma_{i+1} - sigma_i) * v`` and defines the estimate as ``x_i - sigma_i * v`` (its
stochastic branch), so from two consecutive steps' latents ``x0 = x_i - sigma_i * (x_{i+1} -
x_i) / (sigma_{i+1} - sigma_i)``, exact in float32; after the last step (sigma 0) it is the final
latents. The first step has no latents before it to take ``v`` from, and other schedulers
(CogVideoX's DDIM and DPM, a stochastic flow-matching one) no estimate the callback can
reach (their ``_callback_tensor_inputs`` hold the latents only): those previews decode the
latents as they are, and say so (``Preview.denoised``). In bf16 pipelines the latents are
rounded to bf16 after each step, which the difference of two steps magnifies by ``sigma_i /
(sigma_i - sigma_{i+1})``: early previews are the noisier (docs/evaluation.md).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from taehv_train.base.atomic import atomic_write

from .diffusers_vae import TAEVideoVAE, pipeline_config
from .latent_spaces import LatentTransform
from .taehv import TAEHV
from .vae_classes import REF_VAE_CLASSES
from .vae_registry import ref_vae_class_of, reference_transform

logger = logging.getLogger(__name__)

# how each pipeline package lays out the latents its callback gets; the rest: NCTHW (Wan, HunyuanVideo, ...)
FRAMES_FIRST = {"cogvideo"}  # pipeline_cogvideox.py decode_latents permutes (B, T, C, H, W) to NCTHW
PACKED = {"ltx"}  # pipeline_ltx.py packs them into (B, tokens, features); its _unpack_latents undoes it
STRIP_FRAMES = 8  # frames in a step's strip image, evenly spaced over the preview


@dataclass(frozen=True)
class Preview:
    """One step's preview: the first sample's frames, float NTCHW in [0, 1] on the CPU (N = 1)."""

    step: int
    denoised: bool  # True: the scheduler's denoised estimate; False: the latents as they are
    video: torch.Tensor

    def frames(self) -> torch.Tensor:
        """The frames as uint8 THWC (RGB), for image and video writers."""
        return self.video[0].mul(255).round().to(torch.uint8).permute(0, 2, 3, 1)

    def strip(self) -> torch.Tensor:
        """Up to ``STRIP_FRAMES`` evenly spaced frames side by side, uint8 HWC."""
        frames = self.frames()
        picked = torch.linspace(0, len(frames) - 1, min(STRIP_FRAMES, len(frames))).round().long()
        return torch.cat(list(frames[picked]), dim=1)


class LivePreview:
    """A ``callback_on_step_end`` that decodes the denoised estimate with a TAE every
    ``every`` steps (and at the last), keeps the latest (``latest``) and, with ``out``,
    writes each as ``step_0007.png``, a strip of its frames."""

    def __init__(
        self,
        tae: TAEHV | TAEVideoVAE,
        pipe: object,
        every: int = 1,
        out: str | os.PathLike | None = None,
        latent_frames: int | None = None,
        video_size: tuple[int, int, int] | None = None,
    ):
        """``tae`` a TAE of the pipeline's video model (its space converted with the statistics of
        ``pipe.vae``); ``latent_frames``: decode only the first ones (1: one frame, ComfyUI's
        preview); ``video_size``: (num_frames, height, width) as passed to a pipeline that packs its
        latents into tokens (LTX), whose callback cannot tell them."""
        if every < 1:
            raise ValueError(f"every must be 1 or more (a preview every that many steps), got {every}")
        if latent_frames is not None and latent_frames < 1:
            raise ValueError(f"latent_frames must be 1 or more, or None for all, got {latent_frames}")
        if isinstance(tae, TAEHV):
            tae = TAEVideoVAE(tae, pipeline_config(tae, pipe.vae), like=pipe.vae)
        self.vae, self.every, self.latent_frames = tae, every, latent_frames
        self.out = Path(out) if out is not None else None
        self.pipeline_transform = pipeline_transform(pipe, tae.tae.variant)
        self.layout = type(pipe).__module__.split(".")[2] if type(pipe).__module__.startswith("diffusers.") else ""
        if self.layout in PACKED and video_size is None:
            raise ValueError(
                f"{type(pipe).__name__} packs its latents into tokens: pass video_size=(num_frames, height, width) "
                "as given to the pipeline"
            )
        self.video_size = video_size
        self.latest: Preview | None = None
        self._previous: tuple[int | None, torch.Tensor] | None = None  # (scheduler step index, first sample's latents)
        logger.info(
            "live preview: %s decodes %s from the pipeline's %s",
            tae.tae.variant,
            tae.transform.describe(),
            self.pipeline_transform.describe(),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike, pipe: object, **options) -> LivePreview:
        """A TAE weight file (variant and space from its name or metadata) previewing ``pipe``;
        its dtype follows the pipeline's VAE. ``options``: those of ``__init__``."""
        vae = TAEVideoVAE.from_file(path, like=pipe.vae)
        return cls(vae.to(dtype=pipe.vae.dtype), pipe, **options)

    @torch.no_grad()
    def __call__(self, pipe: object, step: int, timestep: object, callback_kwargs: dict) -> dict:
        """The diffusers callback: previews step ``step`` when chosen and hands the kwargs back unchanged."""
        latents = self.unpacked(pipe, callback_kwargs["latents"][:1]).float()
        # flow matching's scheduler, after its step: it went from sigmas[index - 1] to sigmas[index]
        index = getattr(pipe.scheduler, "step_index", None)
        previous, self._previous = self._previous, (index, latents)
        last = step == pipe.num_timesteps - 1
        if step % self.every and not last:
            return callback_kwargs
        estimate = denoised(pipe.scheduler, index, previous, latents)
        self.latest = Preview(step, estimate is not None, self.decode(latents if estimate is None else estimate))
        if self.out is not None:
            self.write(self.latest)
        return callback_kwargs

    def unpacked(self, pipe: object, latents: torch.Tensor) -> torch.Tensor:
        """The callback's latents as NTCHW."""
        if self.layout in PACKED:
            frames, height, width = self.video_size
            latents = pipe._unpack_latents(
                latents,
                (frames - 1) // pipe.vae_temporal_compression_ratio + 1,  # pipeline_ltx.py __call__'s latent sizes
                height // pipe.vae_spatial_compression_ratio,
                width // pipe.vae_spatial_compression_ratio,
                pipe.transformer_spatial_patch_size,
                pipe.transformer_temporal_patch_size,
            )
        latents = latents if self.layout in FRAMES_FIRST else latents.transpose(1, 2)
        channels = self.vae.tae.latent_channels
        if latents.ndim != 5 or latents.shape[2] != channels:
            raise ValueError(
                f"{type(pipe).__name__}'s callback latents have shape {tuple(latents.shape)} as NTCHW, not "
                f"{channels} latent channels of {self.vae.tae.variant}: a TAE of another video model?"
            )
        return latents

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pipeline-space NTCHW latents -> the TAE's frames (float NTCHW in [0, 1], CPU)."""
        if self.latent_frames is not None:
            latents = latents[:, : self.latent_frames]
        tae = self.vae.tae
        if next(tae.parameters()).device != latents.device:
            self.vae.to(latents.device)
        z = latents  # the pipeline's space is the TAE's (most published TAEs): decoded as they are
        if self.pipeline_transform != self.vae.transform:
            z = self.vae.transform.to_tae(self.pipeline_transform.to_raw(latents))
        return tae.decode_video(z.to(self.vae.dtype), parallel=self.vae.parallel).float().cpu()

    def write(self, preview: Preview) -> Path:
        from PIL import Image  # diffusers' own dependency

        path = self.out / f"step_{preview.step:04d}.png"
        return atomic_write(path, lambda tmp: Image.fromarray(preview.strip().numpy()).save(tmp, format="PNG"))


def pipeline_transform(pipe: object, variant: str) -> LatentTransform:
    """The map between raw latents and the space ``pipe`` hands its transformer, with the
    statistics of ``pipe.vae`` (the pipeline undoes this map before ``vae.decode``)."""
    ref_vae_class = ref_vae_class_of(variant)
    if ref_vae_class is None:
        raise ValueError(f"no diffusers pipeline is known for {variant}'s latents: it cannot preview one")
    space = REF_VAE_CLASSES[ref_vae_class].pipeline_space
    return reference_transform(space, ref_vae_class, dict(pipe.vae.config), pipe.vae)


def denoised(
    scheduler: object, index: int | None, previous: tuple[int | None, torch.Tensor] | None, latents: torch.Tensor
) -> torch.Tensor | None:
    """The flow-matching estimate of step ``index - 1`` from the latents before it
    (``previous``, kept at scheduler step ``index - 1``) and after it; None where the
    scheduler gives none the callback can reach (see the module's docstring)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if not isinstance(scheduler, FlowMatchEulerDiscreteScheduler) or scheduler.config.stochastic_sampling:
        return None
    if previous is None or previous[0] != index - 1:
        return None
    sigma, sigma_next = (float(s) for s in scheduler.sigmas[index - 1 : index + 1])
    before = previous[1]
    return before - sigma * (latents - before) / (sigma_next - sigma)
