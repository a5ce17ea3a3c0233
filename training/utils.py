"""The frozen reference VAE (CogVideoX, HunyuanVideo or Wan via diffusers).

TAEHV lives in the reference VAE's latent space, so its latents are the teacher: encoder
targets, and decoder inputs. It is loaded once, frozen, kept out of ``accelerator.prepare``
(DeepSpeed would demand an optimizer for it), and a missing or broken model is an error at
start-up, never a silent fallback to another VAE or to random latents.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
VAE_CLASSES = {
    "cogvideox": "AutoencoderKLCogVideoX",
    "hunyuan": "AutoencoderKLHunyuanVideo",
    "wan": "AutoencoderKLWan",
}


def to_diffusers(frames: torch.Tensor) -> torch.Tensor:
    """NTCHW in [0, 1] -> diffusers' NCTHW in [-1, 1]."""
    return frames.permute(0, 2, 1, 3, 4).mul(2).sub(1)


def from_diffusers(latents: torch.Tensor) -> torch.Tensor:
    """diffusers' NCTHW latents -> NTCHW (TAEHV's layout)."""
    return latents.permute(0, 2, 1, 3, 4)


class ReferenceVAE:
    """Frozen diffusers VAE that returns raw (unscaled) NTCHW latents for NTCHW frames."""

    def __init__(self, path: str | Path, vae_class: str = "cogvideox", subfolder: str = "vae",
                 dtype: str = "bf16", device: torch.device | str = "cpu", sample: bool = True):
        import diffusers

        if vae_class not in VAE_CLASSES:
            raise ValueError(f"ref_vae_class must be one of {sorted(VAE_CLASSES)}, got {vae_class!r}")
        path = Path(path)
        if not (path / subfolder / "config.json").is_file():
            raise FileNotFoundError(
                f"reference VAE not found: expected {path / subfolder / 'config.json'} "
                f"(a diffusers model folder, e.g. a local copy of THUDM/CogVideoX-2b with its '{subfolder}' subfolder)"
            )
        cls = getattr(diffusers, VAE_CLASSES[vae_class])
        self.vae = cls.from_pretrained(path, subfolder=subfolder, torch_dtype=DTYPES[dtype]).to(device).eval()
        self.vae.requires_grad_(False)
        self.dtype = DTYPES[dtype]
        self.sample = sample
        self.latent_channels = self.vae.config.latent_channels
        logger.info("reference VAE %s from %s (%s, %.1fM parameters, %d latent channels)", VAE_CLASSES[vae_class], path,
                    dtype, sum(p.numel() for p in self.vae.parameters()) / 1e6, self.latent_channels)

    @torch.no_grad()
    def encode(self, frames: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Raw latents (NTCHW, float32) of NTCHW frames in [0, 1]; no scaling factor applied."""
        dist = self.vae.encode(to_diffusers(frames).to(self.dtype)).latent_dist
        latents = dist.sample(generator=generator) if self.sample else dist.mode()
        return from_diffusers(latents).float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """NTCHW frames in [0, 1] from raw NTCHW latents."""
        frames = self.vae.decode(latents.permute(0, 2, 1, 3, 4).to(self.dtype)).sample
        return frames.permute(0, 2, 1, 3, 4).float().add(1).div(2).clamp(0, 1)
