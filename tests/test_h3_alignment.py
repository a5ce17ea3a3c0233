"""taeh3's frame plan against diffusers' AutoencoderKLMiniMaxH3 (docs/h3_alignment.md).

A tiny H3 VAE is saved and loaded back; perturbing one input frame or one latent at a time
shows how the VAE groups frames into latents and latents into decoded frames. The VAE's
latent and decoded counts must be taeh3's plan, and decoded frame i must show input frame
i (the last input frame past the end of the clip), as ``FramePlan.target`` assumes.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def h3():
    from tools import h3_alignment

    return h3_alignment


@pytest.fixture(scope="module")
def vae(h3, tmp_path_factory):
    from diffusers import AutoencoderKLMiniMaxH3

    folder = tmp_path_factory.mktemp("h3") / "vae"
    torch.manual_seed(0)
    AutoencoderKLMiniMaxH3(**h3.TINY_CONFIG).save_pretrained(folder)
    return AutoencoderKLMiniMaxH3.from_pretrained(folder).eval()


@pytest.mark.parametrize("frames", [20, 34])
def test_taeh3_plan_is_the_h3_vae_alignment(h3, vae, frames):
    result = h3.measure(vae, frames, seed=0)
    assert (result["vae_latents"], result["vae_decoded"]) == (result["tae_latents"], result["tae_decoded"])
    assert result["mapping_is_identity"], result["mapping"]


def test_the_h3_vae_decodes_nothing_up_to_17_frames(h3, vae):
    """Two latents are too few for its decoder's windows: with a reference H3 VAE, training
    clips need more than 17 frames (the config check says so)."""
    result = h3.measure(vae, 17, seed=0)
    assert result["vae_latents"] == result["tae_latents"] == 2 and result["vae_decoded"] is None
