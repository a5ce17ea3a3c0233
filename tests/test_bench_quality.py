"""bench/bench_quality.py runs end to end (tiny settings): the recipe, the naive loop, an
ablation and the progressive two-stage recipe, JSON and plot. Its clips: the six procedural
demo clips (48x64, as many files as ../shared/videos holds), whose decoding costs nothing
next to the runs."""

from __future__ import annotations

import json
import subprocess
import sys

import cv2
import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.slow  # a benchmark


def test_quality_benchmark_runs_its_arms_on_held_out_files(demo_clips, tmp_path):
    args = [
        sys.executable,
        "-m",
        "bench.bench_quality",
        "--videos",
        str(demo_clips["root"]),
        "--steps",
        "2",
        "--points",
        "1",
        "--frames",
        "5",
        "--size",
        "32",
        "--batch",
        "2",
        "--out",
        str(tmp_path),
        "--arms",
        "recipe",
        "naive",
        "stride_1",
        "progressive",
    ]
    result = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report == json.loads((tmp_path / "quality.json").read_text())
    train = json.loads((tmp_path / "annotations_train.json").read_text())["list"]
    assert report["held_out"] and not {e["path"] for e in train} & set(report["held_out"])  # other files
    assert list(report["curves"]) == ["recipe", "naive", "stride_1", "progressive"]
    recipe, ablation = (json.loads((tmp_path / arm / "config.json").read_text()) for arm in ("recipe", "stride_1"))
    changed = {key for key in recipe if recipe[key] != ablation[key]}
    assert changed == {"run_name", "stride_max"} and ablation["stride_max"] == 1  # one default off, nothing else
    for arm in report["curves"]:
        curve = report["curves"][arm]
        steps = [1, 2] if arm == "progressive" else [2]  # stage 1's step, then stage 2's after it
        assert [p["step"] for p in curve] == steps and 0 < curve[-1]["psnr"] < 60 and curve[-1]["seconds"] > 0
    stage2 = json.loads((tmp_path / "progressive_stage2" / "config.json").read_text())
    assert (stage2["train_encoder"], stage2["height"]) == (False, 32) and stage2["pretrained_model_path"].endswith(
        "progressive_stage1/export/taehv_own_latents.pth"
    )
    plot = cv2.imread(str(tmp_path / "quality.png"))
    assert plot is not None and plot.shape[1] >= 1000 and plot.std() > 10
