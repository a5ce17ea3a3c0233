"""Which latent space does a tensor look like?
``python -m taehv_train.training.which_latents FILE --ref_vae_class wan``.

Latents saved by a pipeline, a sampler or another tool carry no label: raw VAE latents,
the transformer's scaled or normalised ones (``models.latent_spaces``). This compares
their per-channel mean and std with what each space of the reference VAE expects
(``guess_space``, the check training and inference also use) and prints the verdict. The
statistics come from ``--ref_vae_path`` (its ``config.json``, and for LTX its weights'
buffers) or, without it, from the diffusers class defaults (the released models' values
for Wan 2.1, HunyuanVideo, CogVideoX, Mochi, Cosmos, Qwen-Image 2.1, ...).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from taehv_train.base.errors import UserError
from taehv_train.base.flags import ArgumentParser
from taehv_train.models.latent_spaces import guess_space
from taehv_train.models.vae_classes import REF_VAE_CLASSES
from taehv_train.models.vae_registry import class_defaults, latent_space, read_vae_config, spaces_of
from taehv_train.models.weights import all_finite, read_tensors

logger = logging.getLogger(__name__)
LAYOUTS = ("NCTHW", "NTCHW")


def read_latents(path: Path) -> torch.Tensor:
    """The one tensor in a ``.pth``/``.pt`` (a tensor or a dict of one, loaded with
    ``weights_only=True``) or ``.safetensors`` file (``models.weights.read_tensors``: a file
    that is none of these is a WeightsError); an empty tensor or one with NaN or Inf values
    has no statistics to compare, so it is a UserError too."""
    if not path.exists():
        raise UserError(f"{path} not found")
    value = read_tensors(path)
    tensors = [value] if isinstance(value, torch.Tensor) else list(value.values()) if isinstance(value, dict) else []
    if len(tensors) != 1 or not isinstance(tensors[0], torch.Tensor) or tensors[0].ndim != 5:
        raise UserError(f"{path} must hold one 5-dimensional latent tensor (NCTHW or NTCHW)")
    latents = tensors[0].float()
    if not latents.numel():
        raise UserError(f"{path} holds an empty tensor {tuple(latents.shape)}: no latents to tell the space of")
    if not all_finite(latents):
        raise UserError(f"{path} holds NaN or infinite values: latents from a run that diverged, or a damaged file")
    return latents


def main(argv: list[str] | None = None) -> str:
    parser = ArgumentParser(description="Tell which latent space (raw, scaled, normalised) a latent tensor is in.")
    parser.add_argument("latents", help="a .pth/.pt/.safetensors file holding one 5-D latent tensor")
    parser.add_argument("--ref_vae_class", required=True, choices=sorted(REF_VAE_CLASSES), help="its VAE's class")
    parser.add_argument("--ref_vae_path", default="", help="the VAE's diffusers folder (default: class defaults)")
    parser.add_argument("--ref_vae_subfolder", default="vae")
    parser.add_argument("--layout", default="NCTHW", choices=LAYOUTS, help="NCTHW: diffusers' (default)")
    args = parser.parse_args(argv)
    latents = read_latents(Path(args.latents))
    if args.layout == "NCTHW":
        latents = latents.transpose(1, 2)
    module = None
    if args.ref_vae_path:
        folder = Path(args.ref_vae_path) / args.ref_vae_subfolder
        try:
            config = read_vae_config(folder)
        except ValueError as err:
            raise UserError(f"--ref_vae_path: {err}") from None
        if args.ref_vae_class in ("ltx", "ltx2"):  # its statistics are buffers in its weights
            from taehv_train.common.reference_vae import ReferenceVAE

            module = ReferenceVAE(args.ref_vae_path, args.ref_vae_class, args.ref_vae_subfolder, "fp32").vae
    else:
        config = class_defaults(args.ref_vae_class)
    channels = latent_space(args.ref_vae_class, config).latent_channels
    if latents.shape[2] != channels:
        raise UserError(
            f"{args.latents} holds {tuple(latents.shape)} ({args.layout}): {latents.shape[2]} channels, but the "
            f"{REF_VAE_CLASSES[args.ref_vae_class].diffusers_class} has {channels}; check --layout and --ref_vae_class"
        )
    try:
        verdict = f"{args.latents}: {guess_space(latents, spaces_of(args.ref_vae_class, config, module)).describe()}"
    except ValueError as err:  # statistics that do not fit the latents (Cosmos's cover a few latent frames)
        raise UserError(f"{args.latents} ({tuple(latents.shape)}, {args.layout}): {err}") from None
    print(verdict)
    return verdict


if __name__ == "__main__":
    from taehv_train.base.errors import exit_on_user_error

    exit_on_user_error(main)
