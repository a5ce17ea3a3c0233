"""Annotation CLI: probing, skip report, grouped deterministic split, users' format."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from common.clips import ClipTable, VideoClipDataset
from common.errors import UserError
from training import make_annotations
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


def clip_folder(demo_clips: dict[str, Path], folder: Path, count: int = 2) -> Path:
    """``folder`` with links to ``count`` of the tiny demo clips (``clip_00000.mp4`` ...)."""
    folder.mkdir(parents=True, exist_ok=True)
    for clip in sorted((demo_clips["root"] / "videos").glob("*.mp4"))[:count]:
        (folder / clip.name).symlink_to(clip)
    return folder


def read_list(path: Path) -> list[dict]:
    return json.loads(path.read_text())["list"]


@pytest.mark.slow  # a process of the tool
def test_fifo_and_device_are_reported_without_being_opened(demo_clips, tmp_path):
    src = clip_folder(demo_clips, tmp_path / "videos")
    os.mkfifo(src / "pipe.mp4")  # opening it would wait for a writer forever
    (src / "to_pipe.mkv").symlink_to(src / "pipe.mp4")
    (src / "null.mp4").symlink_to(os.devnull)
    out = tmp_path / "a.json"
    result = run_cli(str(src), "-o", str(out), "--group_regex", "", "--val_fraction", "0.5", "--workers", "2")
    assert result.returncode == 0, result.stderr
    reasons = {s["path"]: s["reason"] for s in read_list(tmp_path / "a_skipped.json")}
    assert set(reasons) == {"null.mp4", "pipe.mp4", "to_pipe.mkv"}
    assert reasons["null.mp4"] == "not a regular file: a character device"
    assert reasons["pipe.mp4"].startswith("not a regular file: a FIFO")
    assert reasons["to_pipe.mkv"] == reasons["pipe.mp4"]
    assert "pipe.mp4: not a regular file: a FIFO" in result.stdout
    kept = read_list(tmp_path / "a_train.json") + read_list(tmp_path / "a_val.json")
    assert sorted(e["path"] for e in kept) == ["clip_00000.mp4", "clip_00001.mp4"]


@pytest.mark.parametrize("workers", [1, 2])
def test_probe_past_the_time_limit_is_killed_and_the_rest_carries_on(demo_clips, tmp_path, monkeypatch, workers):
    src = clip_folder(demo_clips, tmp_path / "videos", count=3)
    for name in ("a_crash.mp4", "b_stuck.mp4"):  # copies: the probe sees resolved paths
        (src / name).write_bytes((src / "clip_00000.mp4").read_bytes())
    real_probe = make_annotations.probe_video

    def probe(path, threads=1):  # forked workers inherit this
        if path.name == "b_stuck.mp4":
            time.sleep(60)
        if path.name == "a_crash.mp4":
            os.kill(os.getpid(), signal.SIGKILL)  # as a decoder crash ends the process
        return real_probe(path, threads)

    monkeypatch.setattr(make_annotations, "probe_video", probe)
    out = tmp_path / "a.json"
    argv = [str(src), "-o", str(out), "--group_regex", "", "--val_fraction", "0.3", "--probe_timeout", "1"]
    argv += ["--workers", str(workers)]
    started = time.monotonic()
    assert main(argv) == 0
    assert time.monotonic() - started < 10
    skipped = read_list(tmp_path / "a_skipped.json")
    assert skipped == [
        {"path": "a_crash.mp4", "reason": "probe process died (signal SIGKILL)"},
        {"path": "b_stuck.mp4", "reason": "timed out after 1 s"},
    ]
    train, val = ([e["path"] for e in read_list(tmp_path / f"a_{part}.json")] for part in ("train", "val"))
    assert train == sorted(train) and len(val) == 1  # sorted by path, whatever finished first
    assert sorted(train + val) == ["clip_00000.mp4", "clip_00001.mp4", "clip_00002.mp4"]


def test_flags_out_of_range_and_existing_outputs_are_refused_before_probing(tmp_path, monkeypatch, capsys):
    for flag, value in [("--min_frames", "-3"), ("--workers", "0"), ("--probe_timeout", "0")]:
        with pytest.raises(SystemExit) as exit_info:
            main([str(tmp_path), "-o", str(tmp_path / "a.json"), flag, value])
        assert exit_info.value.code == 2
        assert f"argument {flag}: must be" in capsys.readouterr().err

    (tmp_path / "a_train.json").write_text("{}")
    (tmp_path / "a_skipped.json").write_text("{}")
    monkeypatch.setattr(make_annotations, "probe_all", None)  # probing would fail the test
    with pytest.raises(UserError, match=r"already holds a_train.json, a_skipped.json: pass --force"):
        main([str(tmp_path), "-o", str(tmp_path / "a.json")])


@pytest.mark.slow  # a process of the tool
def test_cli_refuses_to_overwrite_in_one_line(tmp_path):
    (tmp_path / "a_val.json").write_text("{}")
    result = run_cli(str(tmp_path), "-o", str(tmp_path / "a.json"))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: {tmp_path} already holds a_val.json: pass --force to replace them, or another -o"
    ]
    assert (tmp_path / "a_val.json").read_text() == "{}"


def test_image_folder_is_annotated_for_rgba_training(demo_clips, tmp_path, capsys):
    src = tmp_path / "images"
    src.mkdir()
    rgba = np.zeros((6, 10, 4), np.uint8)
    rgba[..., 3] = 128
    for i in range(3):
        cv2.imwrite(str(src / f"still_{i}.png"), rgba)
    out = tmp_path / "a.json"
    assert main([str(src), "-o", str(out), "--val_fraction", "0"]) == 0
    assert "no videos under" in capsys.readouterr().out
    entries = read_list(tmp_path / "a_train.json")
    assert [e["path"] for e in entries] == ["still_0.png", "still_1.png", "still_2.png"]
    assert all((e["frames"], e["width"], e["height"]) == (1, 10, 6) and "fps" not in e for e in entries)

    ds = VideoClipDataset(annotation_file=tmp_path / "a_train.json", n_frames=1, height=6, width=10, channels=4)
    frames = ds[0]["frames"]
    assert frames.shape == (1, 4, 6, 10) and int(frames[0, 3].max()) == 128
    assert list(ClipTable.from_annotation(tmp_path / "a_train.json").frames) == [1, 1, 1]

    # Next to videos, images come with --images only.
    clip_folder(demo_clips, src, count=1)
    assert main([str(src), "-o", str(out), "--val_fraction", "0", "--force"]) == 0
    assert [e["path"] for e in read_list(tmp_path / "a_train.json")] == ["clip_00000.mp4"]
    assert main([str(src), "-o", str(out), "--val_fraction", "0", "--force", "--images"]) == 0
    assert len(read_list(tmp_path / "a_train.json")) == 4


def test_one_group_warns_with_the_command_that_splits(demo_clips, tmp_path, capsys):
    src = clip_folder(demo_clips, tmp_path / "videos", count=6)
    out = tmp_path / "a.json"
    assert main([str(src), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "warning: the validation file is empty: all 6 clips are in one group, 'clip'" in err
    command = err.split("to fix it, run: ")[1].strip()
    again = shlex.split(command)
    assert again[:3] == ["python", "-m", "training.make_annotations"] and again[-3:] == ["--group_regex", "", "--force"]
    assert main(again[3:]) == 0
    assert len(read_list(tmp_path / "a_val.json")) == 1

    single = clip_folder(demo_clips, tmp_path / "single", count=1)
    assert main([str(single), "-o", str(tmp_path / "b.json")]) == 1
    assert "a single clip cannot be split" in capsys.readouterr().err
    assert main([str(single), "-o", str(tmp_path / "b.json"), "--val_fraction", "0", "--force"]) == 0
