#!/usr/bin/env python3
"""Save a randomly initialised reference VAE with the real architecture (diffusers folder).

Speed and memory benchmarks need the reference VAE's architecture, not its weights, and
nothing can be downloaded on benchmark machines:

    python -m tools.make_reference_vae /tmp/cogvideox2b_random     # CogVideoX-2b architecture
then pass ``--ref_vae_path=/tmp/cogvideox2b_random`` to training or inference.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from diffusers import AutoencoderKLCogVideoX

from taehv_train.base.flags import ArgumentParser

# CogVideoX-2b's vae/config.json (the diffusers defaults are this configuration)
COGVIDEOX_2B = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    layers_per_block=3,
    norm_num_groups=32,
    block_out_channels=(128, 256, 256, 512),
    temporal_compression_ratio=4,
    scaling_factor=1.15258426,
    down_block_types=("CogVideoXDownBlock3D",) * 4,
    up_block_types=("CogVideoXUpBlock3D",) * 4,
)


# the same latent channels and compression (latents of the same shape) at a fraction of the
# cost: for CPU runs of benchmarks whose figures depend only on the latents' shape
TINY_COGVIDEOX = dict(COGVIDEOX_2B, layers_per_block=1, norm_num_groups=1, block_out_channels=(4, 4, 4, 4))


def save_reference_vae(out_dir: str | Path, architecture: dict = COGVIDEOX_2B, seed: int = 0) -> int:
    """A seeded random CogVideoX VAE of ``architecture`` saved as ``out_dir/vae`` (what
    ``ref_vae_path=out_dir`` loads); returns its parameter count."""
    torch.manual_seed(seed)
    vae = AutoencoderKLCogVideoX(**architecture)
    vae.save_pretrained(f"{out_dir}/vae")
    return sum(p.numel() for p in vae.parameters())


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    parameters = save_reference_vae(args.out_dir, seed=args.seed)
    print(f"saved a random CogVideoX-2b-architecture VAE ({parameters / 1e6:.1f}M parameters) to {args.out_dir}/vae")


if __name__ == "__main__":
    main()
