"""The frame arithmetic table (T = 1..64) against the model's real output shapes."""

from __future__ import annotations

import pytest
import torch

from taehv_train.models.frames import exact_frame_counts, opensora13_agrees, opensora13_latent_frames, plan_frames
from taehv_train.models.taehv import TAEHV
from taehv_train.models.unloaded_references import reference_latents_note


def expected_counts(t: int, cogvideox: bool) -> tuple[int, int]:
    latents = (t + 3) // 4
    decoded = 4 * latents if (cogvideox and latents % 2 == 0) else 4 * latents - 3
    return latents, decoded


@pytest.mark.parametrize("variant", ["taehv", "taecvx"])
@torch.no_grad()
def test_table_matches_model_for_t_1_to_64(variant):
    model = TAEHV(variant=variant).eval()
    z64 = torch.zeros(1, 16, 16, 1, 1)
    decoded_by_latents = {n: model.decode_video(z64[:, :n]).shape[1] for n in range(1, 17)}
    for t in range(1, 65):
        plan = model.plan(t)
        latents, decoded = expected_counts(t, variant == "taecvx")
        assert (plan.latent_frames, plan.decoded_frames) == (latents, decoded), t
        assert decoded_by_latents[latents] == decoded, t
        assert plan.aligned_frames == min(decoded, t)
    x = torch.rand(1, 13, 3, 8, 8)
    assert model.encode_video(x).shape[1] == model.plan(13).latent_frames


@pytest.mark.parametrize(
    "t, latents, decoded", [(9, 3, 9), (12, 3, 9), (13, 4, 13), (16, 4, 13), (17, 5, 17), (49, 13, 49)]
)
def test_known_base_counts(t, latents, decoded):
    plan = plan_frames(t)
    assert (plan.latent_frames, plan.decoded_frames) == (latents, decoded)


def test_cogvideox_rule():
    assert plan_frames(13, is_cogvideox=True).decoded_frames == 16
    assert plan_frames(12, is_cogvideox=True).decoded_frames == 9
    assert [t for t in exact_frame_counts(50, is_cogvideox=True) if t % 4 == 1] == [1, 9, 17, 25, 33, 41, 49]
    assert exact_frame_counts(20) == [1, 5, 9, 13, 17]


def test_target_alignment():
    x = torch.arange(13.0).view(1, 13, 1, 1, 1)
    assert plan_frames(12).target(x[:, :12]).flatten().tolist() == list(range(9))
    assert plan_frames(17).target(torch.arange(17.0).view(1, 17, 1, 1, 1)).flatten().tolist() == list(range(17))
    # taecvx, 13 frames -> 16 decoded: the last three match the end padding (copies of frame 12)
    assert plan_frames(13, is_cogvideox=True).target(x).flatten().tolist() == list(range(13)) + [12, 12, 12]
    with pytest.raises(ValueError, match="plan is for 12 frames"):
        plan_frames(12).target(x)
    with pytest.raises(ValueError):
        plan_frames(0)


def open_sora_chunk_latents(t: int) -> int:
    """Open-Sora 1.3's VAE encoding a clip of 16k + 1 frames, in our words: chunks of 17
    frames start every 16 frames (hpcaitech/Open-Sora v1.3 opensora/models/vae_v1_3/vae.py
    encode_micro_frame, lines 100-102), each encoded on its own, 17 frames to 17 // 4 + 1
    latents (encoder.py VideoEncoder.forward, lines 114-118)."""
    return sum(min(17, t - start) // 4 + 1 for start in range(0, t - 1, 16))


def open_sora_decoded_frames(latents: int) -> int:
    """Its decoder on them (decode_micro_frame, lines 171-183): 5 latents at a time, each
    chunk decoding to 4 * 5 - 3 = 17 frames, and every chunk after the first merging its
    first frame into the last frame of the one before."""
    chunks = latents // 5
    return 17 * chunks - (chunks - 1)


def test_open_sora_1_3s_chunked_latents_agree_with_taeos1_3_on_one_chunk_only():
    for k in range(1, 8):  # 16k + 1 frames: the clip lengths its VAE encodes and decodes back
        t = 16 * k + 1
        assert opensora13_latent_frames(t) == open_sora_chunk_latents(t) == 5 * k
        assert open_sora_decoded_frames(5 * k) == t
    assert opensora13_latent_frames(1) == plan_frames(1).latent_frames == 1
    assert [t for t in range(1, 129) if opensora13_agrees(t)] == [1, 17, 18, 19, 20]
    # 37 frames: 10 latents each, but Open-Sora's restart at frame 16 (two chunks of 33 frames)
    assert opensora13_latent_frames(37) == plan_frames(37).latent_frames == 10 and not opensora13_agrees(37)
    # 113 frames, configs/opensora-v1-3/inference/t2v.py's num_frames (line 1): 35 latents, taeos1_3's 29
    assert (opensora13_latent_frames(113), plan_frames(113).latent_frames) == (35, 29)
    assert reference_latents_note("taeos1_3", 17) is None
    assert reference_latents_note("taew2_1", 33) is None  # a reference VAE diffusers loads: its own rule
    note = reference_latents_note("taeos1_3_super", 33)  # a super decoder: its base's reference
    assert "Open-Sora 1.3's pipeline has 10 latents for 33 frames" in note and "encodes them to 9 as one" in note
