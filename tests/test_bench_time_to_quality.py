"""bench/bench_time_to_quality.py runs end to end (a few seconds a run): the preset through
the launch script as a user types it with its time budget, the bare loop on the published
model, over two budgets, then the score, JSON, table and plots; and its clip sets. Its clips:
the six procedural demo clips (48x64, as many files as ../shared/videos holds), which the
preset's frame cache and the bare loop decode whole in no time."""

from __future__ import annotations

import json
import subprocess
import sys

import cv2
import pytest

from bench.bench_time_to_quality import split_clips
from conftest import REPO_ROOT


def test_the_clips_a_recipe_is_chosen_on_are_not_those_it_is_reported_on(tmp_path):
    videos = tmp_path / "videos"
    videos.mkdir()
    names = [f"clip{i}.mp4" for i in range(7)]
    for name in names:
        (videos / name).touch()
    train, held_out, sets = split_clips(videos, tmp_path, 3, "choose")
    assert sets == {
        "train": ["clip0.mp4", "clip1.mp4", "clip3.mp4", "clip4.mp4", "clip6.mp4"],
        "choose": ["clip2.mp4"],
        "report": ["clip5.mp4"],
    }
    assert [e["path"] for e in json.loads(held_out.read_text())["list"]] == ["clip2.mp4"]
    assert [e["path"] for e in json.loads(train.read_text())["list"]] == sets["train"]
    with pytest.raises(SystemExit, match="needs at least 8 videos"):
        split_clips(videos, tmp_path, 4, "report")


@pytest.mark.slow  # a benchmark
def test_time_to_quality_benchmark_scores_both_arms_after_the_same_budgets(demo_clips, tmp_path):
    args = [
        sys.executable,
        "-m",
        "bench.bench_time_to_quality",
        "--videos",
        str(demo_clips["root"]),
        "--budgets",
        "1s",
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
    result = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout[: result.stdout.rindex("}") + 1])
    assert report == json.loads((tmp_path / "time_to_quality.json").read_text())
    sets = report["clip_sets"]
    assert report["held_out"] == sets["report"] and not set(sets["report"]) & set(sets["choose"] + sets["train"])
    for arm in ("ours", "bare"):
        assert [(run["budget"], run["seed"]) for run in report["runs"][arm]] == [("1s", 7), ("2s", 7)]
        for run in report["runs"][arm]:
            assert 0 < run["final"]["psnr"] < 60 and run["final"]["sharpness"] > 0
            assert run["curve"] and run["curve"][-1]["seconds"] > 0 and run["seconds"] > 0
    for budget in ("1s", "2s"):
        assert report["difference"][budget]["psnr_db"] == pytest.approx(
            report["summary"]["ours"][budget]["psnr"]["mean"] - report["summary"]["bare"][budget]["psnr"]["mean"]
        )
    run = tmp_path / "ours_2s_7"
    assert "the time budget max_train_time=2s is spent" in (run / "train.log").read_text()  # start-up takes longer
    typed = (run / "command.txt").read_text()  # the command a user types: the budget, data, seed, folder
    assert "scratch --max_train_time=2s --data_root=" in typed and "max_train_steps" not in typed
    assert json.loads((run / "config.json").read_text())["max_train_steps"] == 0
    table = (tmp_path / "time_to_quality.md").read_text()
    assert "| ours | 1s | 1 |" in table and "| bare | 2s | 1 |" in table and "2s: ours - bare:" in table
    for name in ("time_to_quality.png", "time_to_quality_curves.png"):
        plot = cv2.imread(str(tmp_path / name))
        assert plot is not None and plot.std() > 10
    pictures = cv2.imread(str(tmp_path / "time_to_quality_stills.png"))  # original | ours | bare, a row per clip
    assert pictures.shape == (len(report["held_out"]) * 32 * 4, 3 * 32 * 4, 3)
