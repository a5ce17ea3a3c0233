#!/usr/bin/env python3
"""Which input frame does each decoded frame of MiniMax H3's video VAE show?

``taeh3`` has to say which input frame each of its decoded frames matches, and it should
agree with the VAE it imitates, diffusers' ``AutoencoderKLMiniMaxH3``. The real weights
cannot be downloaded here, so this script measures the alignment on a TINY randomly
initialised VAE with the same temporal geometry (17-frame encoder chunks, 4x temporal
compression, 3 dropped latents). Random weights do not reconstruct, so instead of comparing
pictures it perturbs one thing at a time and watches what changes:

* encoder: add a large constant to input frame ``j`` only; the first latent that changes is
  the latent that takes frame ``j`` in (the encoder is a causal CNN);
* decoder: add a large constant to latent ``k`` only and see which decoded frames change.
  The ViT decoder's blocks are residual with zero-initialised output scales, so at
  initialisation every latent decodes to its own 4-frame patch ("local"); with the scales
  set to 1 (as in trained weights) attention mixes every latent of a decode window into
  every frame of it ("mixing");
* mapping: decoded frame ``i`` comes from latent ``k`` at patch position ``p``; ``f(i)`` is
  the ``p``-th input frame latent ``k`` takes in first (frames past the end of the clip are
  the VAE's end padding, copies of the last frame).

The VAE is built, saved with ``save_pretrained`` and loaded back with ``from_pretrained`` in
a temporary folder (nothing is downloaded). Prints a JSON summary; the TAE columns are
``models.frames.plan_frames(T, h3_chunks=True)``. Runs in a few seconds on one CPU thread:

    OMP_NUM_THREADS=1 python -m tools.h3_alignment
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from typing import Any

import diffusers
import torch
from diffusers import AutoencoderKLMiniMaxH3

from taehv_train.base.flags import ArgumentParser
from taehv_train.models.frames import h3_decoded_frames, plan_frames

log = logging.getLogger("h3_alignment")

# Tiny, but the same time axis as the released VAE: temporal factors (1, 2, 2) = 4x after a
# spatial-only first level, clip_length 17 and token_drop 3 (the diffusers defaults).
TINY_CONFIG: dict[str, Any] = dict(
    latent_channels=4,
    block_out_channels=(4, 4, 4),
    layers_per_block=1,
    spatial_downsample_factors=(2, 2, 2),
    temporal_downsample_factors=(1, 2, 2),
    norm_num_groups=2,
    decoder_num_layers=1,
    decoder_num_attention_heads=1,
    decoder_attention_head_dim=8,
    decoder_num_register_tokens=1,
    decoder_ffn_mult=1,
    latents_mean=(0.0,) * 4,
    latents_std=(1.0,) * 4,
)
SIZE = 16  # pixels; 8x spatial compression -> 2x2 latents, below the 256-pixel tile size
KICK = 10.0  # the perturbation added to one frame or one latent
TOL = 1e-5  # a frame or latent "changed" when its largest absolute difference exceeds this
FRAME_COUNTS = (1, 5, 9, 17, 20, 33, 34, 51)


def tae_counts(frames: int) -> tuple[int, int]:
    """taeh3's (latents, decoded frames) for ``frames`` input frames: the repository's plan."""
    plan = plan_frames(frames, h3_chunks=True)
    return plan.latent_frames, plan.decoded_frames


@torch.no_grad()
def decode_counts(vae: AutoencoderKLMiniMaxH3, max_latents: int = 12) -> list[dict[str, Any]]:
    """Decoded frame count (or the error) of the VAE for 1..max_latents latents, next to taeh3's."""
    rows = []
    for latents in range(1, max_latents + 1):
        z = torch.zeros(1, vae.config.latent_channels, latents, SIZE // 8, SIZE // 8)
        try:
            decoded: int | str = vae.decode(z).sample.shape[2]
        except Exception as err:  # noqa: BLE001 - reported, not hidden
            decoded = f"{type(err).__name__}: {err}"
        rows.append({"latents": latents, "vae_decoded": decoded, "tae_decoded": h3_decoded_frames(latents)})
    return rows


def changed(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Indices along time (dim 2) where two (B, C, T, H, W) tensors differ."""
    diff = (a - b).abs().amax(dim=(0, 1, 3, 4))
    return [int(i) for i in torch.nonzero(diff > TOL).flatten()]


def kicked(x: torch.Tensor, index: int) -> torch.Tensor:
    out = x.clone()
    out[:, :, index] += KICK
    return out


def set_decoder_mixing(vae: AutoencoderKLMiniMaxH3, on: bool) -> None:
    """Zero output scales (as initialised) make every ViT block the identity; 1 lets attention mix."""
    for block in vae.decoder.transformer_blocks:
        block.scale1.data.fill_(1.0 if on else 0.0)
        block.scale2.data.fill_(1.0 if on else 0.0)


@torch.no_grad()
def measure(vae: AutoencoderKLMiniMaxH3, frames: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 3, frames, SIZE, SIZE, generator=gen)
    encode = lambda clip: vae.encode(clip).latent_dist.mode()  # noqa: E731
    tae_latents, tae_decoded = tae_counts(frames)
    result: dict[str, Any] = {"T": frames, "tae_latents": tae_latents, "tae_decoded": tae_decoded}

    z = encode(x)
    result["vae_latents"] = z.shape[2]
    # Encoder grouping, on the clip padded the way _encode pads it (copies of the last frame up
    # to a multiple of clip_length), so the padding frames get indices of their own.
    clip = vae.config.clip_length
    padded = x if frames == 1 else torch.cat([x, x[:, :, -1:].repeat(1, 1, (-frames) % clip, 1, 1)], dim=2)
    assert torch.equal(encode(padded), z), "explicit end padding should not change the latents"
    first_latent: dict[int, int] = {}
    reach: dict[int, list[int]] = {k: [] for k in range(z.shape[2])}
    for j in range(padded.shape[2]):
        hit = changed(encode(kicked(padded, j)), z)
        if hit:
            first_latent[j] = hit[0]
        for k in hit:
            reach[k].append(j)
    takes_in = {k: [j for j, first in first_latent.items() if first == k] for k in range(z.shape[2])}
    result["input_frames_lost"] = [j for j in range(frames) if j not in first_latent]

    try:
        set_decoder_mixing(vae, False)
        y = vae.decode(z).sample
    except Exception as err:  # noqa: BLE001 - reported, not hidden
        result["vae_decoded"] = None
        result["decode_error"] = f"{type(err).__name__}: {err}"
        result["latents"] = [{"k": k, "takes_in": takes_in[k], "depends_on": span(reach[k])} for k in range(z.shape[2])]
        return result
    result["vae_decoded"] = y.shape[2]

    local = {k: changed(vae.decode(kicked(z, k)).sample, y) for k in range(z.shape[2])}
    set_decoder_mixing(vae, True)
    y_mix = vae.decode(z).sample
    mixing = {k: changed(vae.decode(kicked(z, k)).sample, y_mix) for k in range(z.shape[2])}
    set_decoder_mixing(vae, False)

    mapping: list[int | None] = []
    for i in range(y.shape[2]):
        owners = [k for k, hit in local.items() if i in hit]
        if len(owners) != 1 or len(local[owners[0]]) != len(takes_in[owners[0]]):
            mapping.append(None)  # not attributable to one latent's frames
            continue
        k = owners[0]
        mapping.append(min(takes_in[k][local[k].index(i)], frames - 1))
    # End to end (local decoder): the earliest decoded frame a kick to input frame j changes.
    earliest = []
    for j in range(frames):
        hit = changed(vae.decode(encode(kicked(x, j))).sample, y)
        earliest.append(hit[0] if hit else None)

    result["latents"] = [
        {
            "k": k,
            "takes_in": takes_in[k],
            "depends_on": span(reach[k]),
            "decodes_to": local[k],
            "mixing_decodes_to": span(mixing[k]),
        }
        for k in range(z.shape[2])
    ]
    result["mapping"] = mapping
    result["mapping_is_identity"] = mapping == [min(i, frames - 1) for i in range(y.shape[2])]
    result["earliest_changed_decoded_frame"] = earliest
    return result


def span(indices: list[int]) -> list[int] | None:
    return [min(indices), max(indices)] if indices else None


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, nargs="*", default=list(FRAME_COUNTS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        AutoencoderKLMiniMaxH3(**TINY_CONFIG).save_pretrained(f"{tmp}/vae")
        vae = AutoencoderKLMiniMaxH3.from_pretrained(f"{tmp}/vae").eval()
    log.info(
        "tiny AutoencoderKLMiniMaxH3: %d parameters, diffusers %s",
        sum(p.numel() for p in vae.parameters()),
        diffusers.__version__,
    )
    summary = {
        "diffusers": diffusers.__version__,
        "geometry": {
            "clip_length": vae.config.clip_length,
            "token_drop": vae.config.token_drop,
            "temporal_compression_ratio": vae.temporal_compression_ratio,
            "frame_pre_padding": vae.frame_pre_padding,
            "tokens_chunk_size": vae.tokens_chunk_size,
            "token_overlap": vae.token_overlap,
            "frame_overlap": vae.frame_overlap,
        },
        "results": [measure(vae, t, args.seed) for t in args.frames],
        "decode_counts": decode_counts(vae),
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
