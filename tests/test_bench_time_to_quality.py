"""bench/bench_time_to_quality.py runs end to end (a few seconds a run): the preset through
the launch script with its time budget, the bare loop on the published model, the score,
JSON, table and plot."""

from __future__ import annotations

import json
import subprocess
import sys

import cv2
import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.slow  # a benchmark


def test_time_to_quality_benchmark_scores_both_arms_after_the_same_budget(videos_dir, tmp_path):
    args = [
        sys.executable,
        "-m",
        "bench.bench_time_to_quality",
        "--videos",
        str(videos_dir),
        "--budget",
        "2s",
        "--seeds",
        "7",
        "--frames",
        "5",
        "--size",
        "32",
        "--batch",
        "1",
        "--points",
        "1",
        "--out",
        str(tmp_path),
    ]
    result = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout[: result.stdout.rindex("}") + 1])
    assert report == json.loads((tmp_path / "time_to_quality.json").read_text())
    for arm in ("ours", "bare"):
        (run,) = report["runs"][arm]
        assert run["seed"] == 7 and 0 < run["final"]["psnr"] < 60 and run["final"]["sharpness"] > 0
        assert run["curve"] and run["curve"][-1]["seconds"] > 0
    assert report["difference"]["psnr_db"] == pytest.approx(
        report["summary"]["ours"]["psnr"]["mean"] - report["summary"]["bare"]["psnr"]["mean"]
    )
    log = (tmp_path / "ours_7" / "train.log").read_text()
    assert "the time budget max_train_time=2s is spent" in log  # start-up alone takes longer
    assert "| ours | 1 |" in (tmp_path / "time_to_quality.md").read_text()
    plot = cv2.imread(str(tmp_path / "time_to_quality.png"))
    assert plot is not None and plot.std() > 10
    pictures = cv2.imread(str(tmp_path / "time_to_quality_stills.png"))  # original | ours | bare, a row per clip
    assert pictures.shape == (len(report["held_out"]) * 32 * 4, 3 * 32 * 4, 3)
