"""One list of reconstruction metrics (common/metrics.py ``ReconstructionMetrics``): the names
and order of validation's columns and of inference's metrics.json, and the same numbers from
both for the same frames."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from conftest import demo_validation_config
from taehv_train.common.clips import frames_to_unit
from taehv_train.common.metrics import ReconstructionMetrics, lpips_unavailable_reason, video_psnr
from taehv_train.evaluation.evaluator import quality_metrics
from taehv_train.models.taehv import TAEHV
from taehv_train.training.data.loading import build_datasets
from taehv_train.training.loop.validation import validate


@pytest.mark.parametrize(
    ("metrics", "names"),
    [
        (ReconstructionMetrics(rgba=False, lpips=False), ["mse", "psnr", "ssim", "sharpness"]),
        (
            ReconstructionMetrics(rgba=True, lpips=True, own=("preview_psnr", "preview_ssim")),
            ["mse", "psnr", "ssim", "sharpness", "preview_psnr", "preview_ssim", "alpha_psnr", "lpips"],
        ),
        (
            ReconstructionMetrics(rgba=True, lpips=False, temporal=True),
            ["mse", "psnr", "ssim", "sharpness", "temporal_error", "psnr_per_frame", "alpha_psnr"],
        ),
    ],
)
def test_the_metrics_are_named_in_the_order_the_outputs_list_them(metrics, names):
    assert metrics.names == names


def test_an_rgba_clip_gets_the_alpha_psnr_and_the_callers_own_values_in_place():
    torch.manual_seed(0)
    target = torch.rand(1, 3, 4, 8, 8)
    decoded = (target + 0.05 * torch.randn_like(target)).clamp(0, 1)
    own = {"preview_psnr": torch.tensor([1.0])}
    measured = ReconstructionMetrics(rgba=True, lpips=False, own=("preview_psnr",))(decoded, target, own)
    assert list(measured) == ["mse", "psnr", "ssim", "sharpness", "preview_psnr", "alpha_psnr"]
    assert measured["preview_psnr"] is own["preview_psnr"]
    assert measured["alpha_psnr"] == video_psnr(decoded[:, :, 3:], target[:, :, 3:])


class Recorded:
    """A dataset that keeps the items validation took, so a test can measure the same frames."""

    def __init__(self, dataset):
        self.dataset, self.items = dataset, []

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        self.items.append(self.dataset[index])
        return self.items[-1]


@torch.no_grad()
def test_validation_and_the_evaluator_give_the_same_numbers_for_the_same_frames(demo_clips):
    config = demo_validation_config(demo_clips)
    model, clips = TAEHV(variant="taehv"), Recorded(build_datasets(config)[1])
    validated = validate(Accelerator(cpu=True), model, clips, config, None, torch.float32)
    frames = frames_to_unit(clips.items[0]["frames"].unsqueeze(0), torch.device("cpu"))
    plan = model.plan(frames.shape[1])
    decoded, target = plan.aligned(model.decode_video(model.encode_video(frames)).float(), frames)
    evaluated = quality_metrics(decoded, target, lpips_unavailable_reason() is None)
    shared = [name for name in evaluated if f"val/{name}" in validated]
    assert shared == ["mse", "psnr", "ssim", "sharpness"] + (["lpips"] if "lpips" in evaluated else [])
    for name in shared:
        assert validated[f"val/{name}"] == pytest.approx(evaluated[name], rel=1e-6), name
