"""Demo dataset generator: deterministic moving content, readable by the dataset."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from taehv_train.common.clips import VideoClipDataset
from taehv_train.common.video.probe import probe_video
from taehv_train.training.demo_data import render_clip

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_render_is_deterministic_textured_and_moving():
    a = render_clip(np.random.default_rng(3), 8, 48, 64)
    assert a.shape == (8, 48, 64, 3) and a.dtype == np.uint8
    assert np.array_equal(a, render_clip(np.random.default_rng(3), 8, 48, 64))
    assert not np.array_equal(a, render_clip(np.random.default_rng(4), 8, 48, 64))
    assert a.std(axis=(1, 2)).min() > 10  # textured, not flat
    motion = np.abs(np.diff(a.astype(np.int16), axis=0)).mean(axis=(1, 2, 3))
    assert motion.min() > 1  # every frame moves


def test_demo_dataset_feeds_the_dataset(demo_clips):
    """The session's demo data set: make_demo_dataset with 6 clips of 12 frames (48x64)."""
    root, paths = demo_clips["root"], demo_clips
    train = json.loads(paths["train"].read_text())
    val = json.loads(paths["val"].read_text())
    assert (train["total"], val["total"]) == (5, 1)
    entry = train["list"][0]
    assert set(entry) >= {"path", "frames", "duration"} and entry["frames"] == 12
    assert probe_video(root / entry["path"]).frames == 12

    ds = VideoClipDataset(root, paths["train"], n_frames=6, height=32, width=48)
    sample = ds[3]
    assert sample["frames"].shape == (6, 3, 32, 48) and sample["failures"] == 0
    ds.probe()  # no unusable clips
    # Annotation paths also resolve without data_root (relative to the annotation file).
    assert VideoClipDataset(annotation_file=paths["val"], n_frames=2, height=8, width=8)[0]["failures"] == 0


@pytest.mark.slow  # a process of the tool
def test_demo_cli(tmp_path):
    out = tmp_path / "demo"
    args = ["--num-clips", "3", "--frames", "6", "--height", "32", "--width", "48", "--seed", "7"]
    result = subprocess.run(
        [sys.executable, "-m", "taehv_train.training.demo_data", str(out), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (out / "videos").iterdir()) == [f"clip_{i:05d}.mp4" for i in range(3)]
    assert (out / "annotations_train.json").exists() and (out / "annotations_val.json").exists()
    assert probe_video(out / "videos" / "clip_00002.mp4").width == 48


def test_clips_are_driving_scenes_with_lane_markings_that_move():
    for i in range(4):
        clip = render_clip(np.random.default_rng([0, i]), 12, 96, 144)
        road = clip[:, 66:].astype(np.int16).max(axis=3)  # the bottom of the frame: the road ahead
        markings = road > np.median(road, axis=(1, 2), keepdims=True) + 40  # white or yellow on the asphalt
        assert markings.mean(axis=(1, 2)).min() > 0.01, i  # lane markings in every frame
        assert not np.array_equal(markings[0], markings[6]), i  # ... which move with the camera
        sky = clip[:, :8].astype(np.int16)
        assert (sky[..., 2] > sky[..., 0]).mean() > 0.8, i  # a blue sky on top
