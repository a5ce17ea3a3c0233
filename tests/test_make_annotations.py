"""Annotation CLI: probing, skip report, grouped deterministic split, users' format."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.clips import VideoClipDataset
from training.make_annotations import DEFAULT_GROUP_REGEX, group_key, main, split_train_val

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "training.make_annotations", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow  # a process of the tool
def test_cli_probes_splits_and_reports_skips(videos_dir, tmp_path):
    src = tmp_path / "videos"
    (src / "drive").mkdir(parents=True)
    for clip in videos_dir.glob("*.mp4"):
        (src / clip.name).symlink_to(clip)
    (src / "zero.mp4").write_bytes(b"")
    (src / "drive" / "notes.mkv").write_text("not a video")
    (src / "cut.mp4").write_bytes((videos_dir / "udacity_alf_project_video_start_200f.mp4").read_bytes()[:300_000])
    (src / "gone.mp4").symlink_to(tmp_path / "does_not_exist.mp4")
    (src / "readme.txt").write_text("ignored: not a video extension")

    out = tmp_path / "ann" / "annotations.json"
    result = run_cli(str(src), "-o", str(out), "--val-fraction", "0.2", "--workers", "2")
    assert result.returncode == 0, result.stderr
    assert "probing videos" in result.stderr  # tqdm progress bar

    train = json.loads((tmp_path / "ann" / "annotations_train.json").read_text())
    val = json.loads((tmp_path / "ann" / "annotations_val.json").read_text())
    skipped = json.loads((tmp_path / "ann" / "annotations_skipped.json").read_text())
    assert train["total"] == len(train["list"]) and val["total"] == len(val["list"])
    kept = {e["path"]: e for e in train["list"] + val["list"]}
    assert set(kept) == {p.name for p in videos_dir.glob("*.mp4")}
    assert 1 <= len(val["list"]) < len(kept)

    shadow = kept["udacity_alf_project_video_shadow_160f.mp4"]
    assert shadow["frames"] == 160  # decodable, not the container's 162
    assert (shadow["width"], shadow["height"], shadow["fps"], shadow["duration"]) == (1280, 720, 25.0, 6.4)
    assert Path(shadow["full_path"]).is_absolute() and Path(shadow["full_path"]).exists()
    assert kept["gopro_max_heromode.mp4"]["frames"] == 315

    # Same drive: the vehicle-detection clip and the shadow clip share a side.
    val_paths = {e["path"] for e in val["list"]}
    assert ("udacity_vehdet_test_video.mp4" in val_paths) == ("udacity_alf_project_video_shadow_160f.mp4" in val_paths)

    reasons = {s["path"]: s["reason"] for s in skipped["list"]}
    assert set(reasons) == {"zero.mp4", "drive/notes.mkv", "cut.mp4", "gone.mp4"}
    assert reasons["gone.mp4"] == "missing"
    assert reasons["zero.mp4"].startswith("unreadable")
    assert "skipped 4" in result.stdout and "gone.mp4: missing" in result.stdout

    # The dataset reads the train annotation as written (paths relative to the folder).
    ds = VideoClipDataset(src, out.with_name("annotations_train.json"), n_frames=3, height=16, width=24)
    assert len(ds) == len(train["list"]) and ds[0]["frames"].shape == (3, 3, 16, 24)
    # ... and without data_root through full_path.
    val_ds = VideoClipDataset(annotation_file=out.with_name("annotations_val.json"))
    assert val_ds.clips.path(0) == val["list"][0]["full_path"]


@pytest.mark.slow  # a process of the tool
def test_cli_fails_clearly_without_usable_videos(tmp_path, capsys):
    (tmp_path / "bad.mp4").write_text("nope")
    result = run_cli(str(tmp_path), "-o", str(tmp_path / "a.json"))
    assert result.returncode == 1
    assert "no usable videos" in result.stdout and "bad.mp4: unreadable" in result.stdout
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nowhere"), "-o", str(tmp_path / "a.json")])
    assert "is not a folder" in capsys.readouterr().err


def test_default_group_key():
    pattern = re.compile(DEFAULT_GROUP_REGEX)
    assert group_key("udacity_vehdet_test_video.mp4", pattern) == "udacity"
    assert group_key("udacity_alf_project_video_shadow_160f.mp4", pattern) == "udacity"
    assert group_key("src/v12/clip_0003.mp4", pattern) == "src/v12/clip"
    assert group_key("cockatoo.mp4", pattern) == "cockatoo"
    assert group_key("a/b.mp4", None) == "a/b.mp4"


def test_split_keeps_groups_together_and_is_deterministic():
    keys = [f"source{i // 4}" for i in range(400)]  # 100 sources of 4 clips
    is_val = split_train_val(keys, 0.1, seed=0)
    assert is_val == split_train_val(keys, 0.1, seed=0)
    assert is_val != split_train_val(keys, 0.1, seed=1)
    assert sum(is_val) == 40
    for start in range(0, 400, 4):
        assert len(set(is_val[start : start + 4])) == 1
    assert not any(split_train_val(keys, 0.0, seed=0))


def test_split_does_not_overshoot_with_big_groups():
    keys = ["big"] * 6 + ["a", "b", "c", "d"]
    is_val = split_train_val(keys, 0.2, seed=0)
    assert sum(is_val) == 2 and not any(is_val[:6])
