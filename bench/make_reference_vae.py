#!/usr/bin/env python3
"""Save a randomly initialised reference VAE with the real architecture (diffusers folder).

Speed and memory benchmarks need the reference VAE's architecture, not its weights, and
nothing can be downloaded on benchmark machines:

    python -m bench.make_reference_vae /tmp/cogvideox2b_random     # CogVideoX-2b architecture
then pass ``--ref_vae_path=/tmp/cogvideox2b_random`` to training or inference.
"""

from __future__ import annotations

import argparse

import torch
from diffusers import AutoencoderKLCogVideoX

from common.flags import ArgumentParser

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


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    vae = AutoencoderKLCogVideoX(**COGVIDEOX_2B)
    vae.save_pretrained(f"{args.out_dir}/vae")
    print(
        f"saved a random CogVideoX-2b-architecture VAE ({sum(p.numel() for p in vae.parameters()) / 1e6:.1f}M "
        f"parameters) to {args.out_dir}/vae"
    )


if __name__ == "__main__":
    main()
