"""The frame arithmetic table (T = 1..64) against the model's real output shapes."""

from __future__ import annotations

import pytest
import torch

from taehv_train.models.frames import exact_frame_counts, plan_frames
from taehv_train.models.taehv import TAEHV


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
