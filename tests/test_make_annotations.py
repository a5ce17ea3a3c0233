"""Annotation CLI: probing, skip report, grouped deterministic split, users' format."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import av
import cv2
import numpy as np
import pytest
from test_launch_script import TINY_SCRATCH, launch

from conftest import tool_exit
from taehv_train.base.errors import UserError
from taehv_train.common.clip_table import ClipTable
from taehv_train.common.clips import VideoClipDataset
from taehv_train.common.video.files import BadClipError
from taehv_train.training import make_annotations
from taehv_train.training.annotate import probe_pool
from taehv_train.training.annotate.annotation_files import output_paths, write_annotation
from taehv_train.training.annotate.annotation_split import DEFAULT_GROUP_REGEX, group_key, split_train_val
from taehv_train.training.annotate.probe_records import probes_path, read_probes, shard_of
from taehv_train.training.make_annotations import main
from train_runs import all_ended, processes_of, wait_for

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "taehv_train.training.make_annotations", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def refused_as_on_the_command_line(capsys, *args: str) -> tuple[int, str, list[str]]:
    """Run the tool in this process as ``python -m taehv_train.training.make_annotations`` runs it, where
    it is expected to refuse: its exit status, stdout and stderr lines (the command line's
    own process is checked by test_cli_refuses_to_overwrite_in_one_line)."""
    return tool_exit(capsys, make_annotations._exit_with_status, *args)


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


def test_the_documented_camera_examples_group_as_the_table_says():
    """docs/data.md's table of camera file names: the default regex splits each source in
    two groups, the regex given keeps it in one."""
    rows = re.findall(
        r"^\| `(.+?)`, `(.+?)` \(.*?\) \| `(.+?)`, `(.+?)` \| `(.+?)` \| `(.+?)` \|$",
        (REPO_ROOT / "docs" / "data.md").read_text(),
        re.M,
    )
    assert len(rows) == 2
    for first, second, default_first, default_second, regex, group in rows:
        default = re.compile(DEFAULT_GROUP_REGEX)
        assert [group_key(first, default), group_key(second, default)] == [default_first, default_second]
        assert group_key(first, re.compile(regex)) == group_key(second, re.compile(regex)) == group


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
def test_probe_past_the_time_limit_is_killed_and_the_rest_carries_on(
    demo_clips, tmp_path, monkeypatch, capsys, workers
):
    src = clip_folder(demo_clips, tmp_path / "videos", count=3)
    for name in ("a_crash.mp4", "b_stuck.mp4"):  # copies: the probe sees resolved paths
        (src / name).write_bytes((src / "clip_00000.mp4").read_bytes())
    real_probe = probe_pool.probe_video

    def probe(path, threads=1):  # forked workers inherit this
        if path.name == "b_stuck.mp4":
            time.sleep(60)
        if path.name == "a_crash.mp4":
            os.kill(os.getpid(), signal.SIGKILL)  # as a decoder crash ends the process
        return real_probe(path, threads)

    monkeypatch.setattr(probe_pool, "probe_video", probe)
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

    # The next run probes those two again (a time-out or a crash can be transient), not the rest.
    monkeypatch.setattr(probe_pool, "probe_video", real_probe)
    capsys.readouterr()
    assert main(argv) == 0
    assert (
        "probed 0 new or changed files (and 2 that timed out or crashed last time), reused 3" in capsys.readouterr().out
    )
    assert read_list(tmp_path / "a_skipped.json") == []


@pytest.mark.slow  # a process of the tool
def test_kill_9_of_the_tool_alone_ends_its_probe_processes(demo_clips, tmp_path):
    """Probes stuck for good (a hung mount) and kill -9 of the tool alone, not its process
    group: its probe processes end with it instead of hanging on."""
    src = clip_folder(demo_clips, tmp_path / "videos")
    stuck_tool = (
        "import sys, time\n"
        "from taehv_train.training import make_annotations as m\n"
        "from taehv_train.training.annotate import probe_pool as p\n"
        "p.probe_video = lambda path, threads=1: time.sleep(600)\n"
        "m.main(sys.argv[1:])"
    )
    command = [sys.executable, "-c", stuck_tool, str(src), "-o", str(tmp_path / "a.json"), "--workers", "2"]
    tool = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: len(processes_of(tmp_path)) == 3, timeout=60, what="the tool and its 2 probe processes")
        job = processes_of(tmp_path)
        tool.kill()
        tool.wait()
        wait_for(lambda: all_ended(job), timeout=30, what="the probe processes to end with the tool")
    finally:
        with contextlib.suppress(ProcessLookupError):  # none left when they ended
            os.killpg(tool.pid, signal.SIGKILL)  # what is left of this test's processes, if it failed


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
    assert again[:3] == [sys.executable, "-m", "taehv_train.training.make_annotations"] and again[-2:] == [
        "--group_regex",
        "",
    ]
    assert main(again[3:]) == 0  # no --force: the records file says these outputs are this run's
    assert "probed 0 new or changed files, reused 6" in capsys.readouterr().out  # the split alone changed
    assert len(read_list(tmp_path / "a_val.json")) == 1

    single = clip_folder(demo_clips, tmp_path / "single", count=1)
    assert main([str(single), "-o", str(tmp_path / "b.json")]) == 1
    assert "a single clip cannot be split" in capsys.readouterr().err
    assert main([str(single), "-o", str(tmp_path / "b.json"), "--val_fraction", "0", "--force"]) == 0


@pytest.mark.slow  # the tool's process, then two training steps through the launch script
def test_the_summary_names_the_files_and_prints_the_command_that_trains_on_them(demo_clips, tmp_path):
    src = clip_folder(demo_clips, tmp_path / "videos", count=6).resolve()
    ann = tmp_path / "ann"
    result = run_cli(str(src), "-o", str(ann / "a.json"), "--group_regex", "")
    assert result.returncode == 0, result.stderr
    assert (
        f"wrote in {ann}: a_train.json (5 clips for training), a_val.json (1 clip held out for validation), "
        "a_skipped.json (0 files left out); probe records: a_probes.jsonl"
    ) in result.stdout
    (command,) = [line.removeprefix("train on them: ") for line in result.stdout.splitlines() if "train on" in line]
    words = shlex.split(command)
    assert words == [
        str(REPO_ROOT / "train_taehv_h100.sh"),  # absolute: it works from any folder
        "1",
        "scratch",
        f"--data_root={src}",
        f"--annotation_file={ann / 'a_train.json'}",
        f"--val_annotation_file={ann / 'a_val.json'}",
    ]
    run = launch(*words[1:], f"--output_dir={tmp_path / 'out'}", *TINY_SCRATCH)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    (run_dir,) = (tmp_path / "out").iterdir()
    assert json.loads((run_dir / "config.json").read_text())["val_annotation_file"] == str(ann / "a_val.json")
    assert "step 2 validation: val/mse=" in (run_dir / "train.log").read_text()


def test_a_rerun_keeps_each_clips_side_and_refuses_another_split(demo_clips, tmp_path, capsys):
    """Clips added to a held-out source are held out with it (a fresh split would move the
    held-out clip into training); other split settings are refused in one line before
    anything is probed, unless --resplit; files that record no settings keep their sides; a
    damaged file is one line that names --resplit, which splits anew without reading it."""
    clips = sorted((demo_clips["root"] / "videos").glob("*.mp4"))
    src = tmp_path / "videos"
    src.mkdir()
    for source, clip in zip("abcde", clips):
        (src / f"{source}_0.mp4").symlink_to(clip)
    out, val = tmp_path / "a.json", tmp_path / "a_val.json"
    annotate(capsys, src, out, "--val_fraction", "0.2")
    (held_out,) = [e["path"] for e in read_list(val)]
    source = held_out.split("_")[0]
    for i in (1, 2, 3):
        (src / f"{source}_{i}.mp4").symlink_to(clips[5])
    stdout = annotate(capsys, src, out, "--val_fraction", "0.2")
    assert [e["path"] for e in read_list(val)] == [f"{source}_{i}.mp4" for i in range(4)]
    assert "probed 3 new or changed files, reused 5" in stdout and "known clips keep their side" in stdout
    recorded = {"val_fraction": 0.2, "seed": 0, "group_regex": DEFAULT_GROUP_REGEX}
    assert json.loads(val.read_text())["split"] == json.loads((tmp_path / "a_train.json").read_text())["split"]
    assert json.loads(val.read_text())["split"] == recorded
    assert len(ClipTable.from_annotation(val, src)) == 4  # readers take the list

    before = outputs(out)
    status, stdout, stderr = refused_as_on_the_command_line(
        capsys, str(src), "-o", str(out), "--val_fraction", "0.5", "--seed", "1"
    )
    assert status == 2
    assert stderr == [
        f"error: a_val.json holds 4 clips held out by a split with --val_fraction 0.2 --seed 0 --group_regex "
        f"{shlex.quote(DEFAULT_GROUP_REGEX)}: splitting with --val_fraction 0.5 --seed 1 instead would move "
        "held-out clips into the training set of runs that use these files; pass --resplit to split anew, "
        "or another -o"
    ]
    assert outputs(out) == before and "probed" not in stdout
    assert "split anew (--resplit)" in annotate(capsys, src, out, "--val_fraction", "0.5", "--seed", "1", "--resplit")
    assert json.loads(val.read_text())["split"]["seed"] == 1

    for path in (val, tmp_path / "a_train.json"):  # as an older make_annotations wrote them
        data = json.loads(path.read_text())
        path.write_text(json.dumps({"total": data["total"], "list": data["list"]}))
    held_out = read_list(val)
    assert "a_val.json records no split settings" in annotate(capsys, src, out, "--val_fraction", "0.1")
    assert read_list(val) == held_out

    val.write_bytes(val.read_bytes()[:40])  # cut off (by another tool, or an edit): its split cannot be kept
    status, _, stderr = refused_as_on_the_command_line(capsys, str(src), "-o", str(out), "--val_fraction", "0.1")
    assert status == 2 and len(stderr) == 1
    assert "a_val.json is no valid JSON" in stderr[0] and stderr[0].endswith(
        "pass --resplit to split anew, or another -o"
    )
    assert "split anew (--resplit)" in annotate(capsys, src, out, "--val_fraction", "0.1", "--resplit")
    assert read_list(val)


# ----------------------------------------------------------------------------------------
# Incremental runs, shards and merge: 300 small files
# ----------------------------------------------------------------------------------------


def tiny_mp4(path: Path, frames: int) -> bytes:
    """A 16x16 H.264 clip of ``frames`` frames (~1.5 kB), written and returned."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width = stream.height = 16
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.full((16, 16, 3), 40 * i, np.uint8), "rgb24")))
        container.mux(stream.encode())
    return path.read_bytes()


def many_clip_folder(folder: Path, count: int = 300) -> Path:
    """``count`` files under ``folder``: copies of a 2-frame and a 4-frame clip in 6
    folders from 40 sources, and 3 unusable files (text, empty, a broken link)."""
    folder.mkdir(parents=True)
    short, long = tiny_mp4(folder.parent / "short.mp4", 2), tiny_mp4(folder.parent / "long.mp4", 4)
    for i in range(count - 3):
        path = folder / f"drive_{i % 6}" / f"src{i % 40}_{i:03d}.mp4"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(long if i % 3 else short)
    (folder / "notes.mp4").write_text("not a video")
    (folder / "drive_1" / "empty.mkv").write_bytes(b"")
    (folder / "gone.mp4").symlink_to(folder / "nowhere.mp4")
    return folder


def outputs(out: Path) -> dict[str, bytes]:
    return {part: path.read_bytes() for part, path in output_paths(out).items()}


def annotate(capsys, src: Path, out: Path, *flags: str) -> str:
    """Run the tool in this process (2 workers); its stdout."""
    capsys.readouterr()
    assert main([str(src), "-o", str(out), "--workers", "2", *flags]) == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def many_clips(tmp_path_factory) -> dict:
    """300 files and the annotation files of one plain run on them (not to be changed)."""
    root = tmp_path_factory.mktemp("many")
    src = many_clip_folder(root / "videos")
    out = root / "one" / "a.json"
    assert main([str(src), "-o", str(out), "--workers", "2"]) == 0
    return {"src": src, "out": out, "outputs": outputs(out)}


def test_shards_then_merge_write_the_files_of_one_machine(many_clips, tmp_path, capsys):
    src, out = many_clips["src"], tmp_path / "a.json"
    reference = many_clips["outputs"]
    assert b'"reason": "missing"' in reference["skipped"] and reference["val"].count(b"\n") > 10
    for k in (1, 2, 3):
        annotate(capsys, src, out, "--shard", f"{k}/3")
    assert not any(p.exists() for p in output_paths(out).values())  # parts only
    parts = [read_probes(probes_path(out, (k, 3))) for k in (1, 2, 3)]
    assert sum(len(p.records) for p in parts) == 300 and all(80 < len(p.records) < 120 for p in parts)
    assert all(shard_of(rel, 3) == k for k, p in enumerate(parts, 1) for rel in p.records)

    assert "probed 0 new or changed files" in annotate(capsys, src, out, "--shard", "2/3")  # incremental too
    stdout = annotate(capsys, src, out, "--merge")
    assert "merged 3 probe parts: 300 videos" in stdout and "probed 0 new or changed files, reused 300" in stdout
    assert outputs(out) == reference  # byte for byte
    # The merge wrote the records of a plain run: one on the same -o (no --force) probes nothing.
    assert "probed 0 new or changed files, reused 300" in annotate(capsys, src, out)
    assert outputs(out) == reference


def test_rerun_probes_only_new_and_changed_files(tmp_path, capsys):
    src, out = many_clip_folder(tmp_path / "videos"), tmp_path / "a.json"
    assert "probed 300 new or changed files, reused 0" in annotate(capsys, src, out)
    first = outputs(out)
    # Unchanged folder: nothing probed, same files (written again without --force).
    assert "probed 0 new or changed files, reused 300" in annotate(capsys, src, out)
    assert outputs(out) == first
    # --min_frames applies to the records: no probe either.
    stdout = annotate(capsys, src, out, "--min_frames", "3")
    assert "probed 0 new or changed files, reused 300" in stdout and "too short" in stdout

    for i in range(5):
        (src / "drive_new" / f"new{i}_clip.mp4").parent.mkdir(exist_ok=True)
        shutil.copy(src / "drive_1" / "src1_001.mp4", src / "drive_new" / f"new{i}_clip.mp4")
    touched = src / "drive_2" / "src2_002.mp4"
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 10**9))
    (src / "drive_3" / "src3_003.mp4").unlink()
    assert "probed 6 new or changed files, reused 298" in annotate(capsys, src, out)
    records = read_probes(probes_path(out)).records
    assert len(records) == 304 and "drive_3/src3_003.mp4" not in records  # a file gone is dropped
    assert records["drive_new/new4_clip.mp4"]["probe"]["frames"] == 4


def test_stopped_run_continues_where_it_stopped(many_clips, tmp_path, capsys):
    src, reference = many_clips["src"], many_clips["outputs"]
    # A kill -9 of the tool mid-way (each probe slowed down to 5 ms) ...
    out = tmp_path / "killed" / "a.json"
    slow_tool = (
        "import sys, time\n"
        "from taehv_train.training import make_annotations as m\n"
        "from taehv_train.training.annotate import probe_pool as p\n"
        "real = p.probe_video; p.probe_video = lambda path, threads=1: (time.sleep(0.005), real(path, threads))[1]\n"
        "m.main(sys.argv[1:])"
    )
    command = [sys.executable, "-c", slow_tool, str(src), "-o", str(out)]
    # in a process group of its own: the kill reaches its probe processes too, as a job scheduler's does
    tool = subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    records_file = probes_path(out)
    deadline = time.monotonic() + 60
    while not (records_file.exists() and records_file.read_bytes().count(b"\n") > 30) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(tool.pid, signal.SIGKILL)
    tool.wait()
    recorded = len(read_probes(records_file).records)
    assert 30 <= recorded < 300 and not read_probes(records_file).complete
    # ... continues with the files not yet recorded.
    stdout = annotate(capsys, src, out)
    assert f"probed {300 - recorded} new or changed files, reused {recorded}" in stdout
    assert outputs(out) == reference

    # A records file cut in the middle of a line (record 150): the torn line is ignored.
    text = records_file.read_text()
    start = text.index("\n".join(text.splitlines()[150:152]))
    records_file.write_text(text[: start + 20])
    assert "probed 151 new or changed files, reused 149" in annotate(capsys, src, out)
    assert outputs(out) == reference


def test_merge_and_shard_mistakes_are_refused_in_one_line(demo_clips, tmp_path, capsys):
    src = clip_folder(demo_clips, tmp_path / "videos", count=3)
    other = clip_folder(demo_clips, tmp_path / "other", count=3)
    out = tmp_path / "a.json"
    refusals = [
        (["--shard", "0/3"], "--shard 0/3: K must be between 1 and N (3)"),
        (["--shard", "4/3"], "--shard 4/3: K must be between 1 and N (3)"),
        (["--shard", "two"], "--shard 'two': expected K/N, e.g. --shard 1/8"),
        (["--merge"], f"no probe parts next to {out} (a_probes.shard-K-of-N.jsonl): run --shard K/N"),
    ]
    for flags, message in refusals:
        with pytest.raises(UserError) as err:
            main([str(src), "-o", str(out), *flags])
        assert str(err.value).startswith(message), str(err.value)

    annotate(capsys, src, out, "--shard", "1/2")
    with pytest.raises(UserError, match=r"^1 of the 2 probe parts are missing next to .*: run --shard 2/2$"):
        main([str(src), "-o", str(out), "--merge"])
    annotate(capsys, other, out, "--shard", "2/2")  # of another folder
    with pytest.raises(UserError, match=rf"a_probes.shard-2-of-2.jsonl holds the probes of {other}, not of {src}"):
        main([str(src), "-o", str(out), "--merge"])
    with pytest.raises(UserError, match=r"holds the probes of .*other.*: pass --force to start over, or another -o"):
        main([str(src), "-o", str(out), "--shard", "2/2"])
    annotate(capsys, src, out, "--shard", "2/2", "--force")
    part = probes_path(out, (2, 2))
    part.write_text(part.read_text().rsplit('{"complete"', 1)[0])  # as when stopped before the end
    with pytest.raises(UserError, match=r"a_probes.shard-2-of-2.jsonl is incomplete .*: run --shard 2/2 again"):
        main([str(src), "-o", str(out), "--merge"])
    annotate(capsys, src, out, "--shard", "2/2")
    annotate(capsys, src, out, "--shard", "1/3")
    status, _, stderr = refused_as_on_the_command_line(capsys, str(src), "-o", str(out), "--merge")
    assert status == 2
    assert stderr == [
        f"error: {tmp_path} holds probe parts of 2 and of 3 shards for a.json: "
        "delete the parts of the sharding no longer in use"
    ]
    probes_path(out, (1, 3)).unlink()
    assert "merged 2 probe parts: 3 videos" in annotate(capsys, src, out, "--merge", "--val_fraction", "0")


def names_in_part(k: int, n: int, count: int) -> list[str]:
    """``count`` file names (``s0_clip.mp4`` ...) whose paths fall in part ``k`` of ``n``."""
    names = (f"s{i}_clip.mp4" for i in range(1000))
    return [name for name in names if shard_of(name, n) == k][:count]


def test_a_merge_probes_what_changed_since_the_shards_ran(demo_clips, tmp_path, capsys):
    """--shard 1/2, then one of its files deleted, one re-encoded shorter and smaller and
    one added to its part, then --shard 2/2 and --merge: the files a one-machine run on
    the final folder writes, byte for byte, with only the two new or changed files probed
    again and the gone one said."""
    clip = sorted((demo_clips["root"] / "videos").glob("*.mp4"))[0]  # 12 frames of 64x48
    src = tmp_path / "videos"
    src.mkdir()
    first, second = names_in_part(1, 2, 5), names_in_part(2, 2, 4)
    for name in first[:4] + second:
        shutil.copy(clip, src / name)
    out, flags = tmp_path / "parts" / "a.json", ("--val_fraction", "0.25")
    annotate(capsys, src, out, "--shard", "1/2", *flags)
    (src / first[0]).unlink()
    tiny_mp4(src / first[1], 2)  # re-encoded: 2 frames of 16x16
    shutil.copy(clip, src / first[4])
    annotate(capsys, src, out, "--shard", "2/2", *flags)
    stdout = annotate(capsys, src, out, "--merge", *flags)
    one = tmp_path / "one" / "a.json"
    annotate(capsys, src, one, *flags)
    assert outputs(out) == outputs(one)
    assert "probed 2 new or changed files, reused 6, dropped the records of 1 file now gone" in stdout
    kept = {e["path"]: e for part in ("train", "val") for e in read_list(output_paths(out)[part])}
    assert sorted(kept) == sorted(first[1:] + second)
    assert (kept[first[1]]["frames"], kept[first[1]]["width"], kept[first[1]]["height"]) == (2, 16, 16)
    # A second merge reuses the records the first one made of the changed files.
    assert "probed 0 new or changed files, reused 8" in annotate(capsys, src, out, "--merge", *flags)


def test_damaged_or_nonsensical_records_cost_one_probe_each(tmp_path, capsys):
    """A records line that is no JSON, or a record of -7 frames, is ignored with one warning
    naming the lines, and only those files are probed again; records an older
    make_annotations wrote (size and mtime_ns only) are reused."""
    src, out = many_clip_folder(tmp_path / "videos", count=20), tmp_path / "a.json"
    assert "probed 20 new or changed files, reused 0" in annotate(capsys, src, out)
    first = outputs(out)
    records_file = probes_path(out)
    lines = records_file.read_text().splitlines(keepends=True)
    lines[4] = '{"path": "drive_1/src1_001.mp4", "size": 15\n'  # damaged in the middle
    record = json.loads(lines[7])
    assert record["probe"]["frames"] > 0
    record["probe"]["frames"] = -7
    lines[7] = json.dumps(record) + "\n"
    records_file.write_text("".join(lines))

    capsys.readouterr()
    assert main([str(src), "-o", str(out), "--workers", "2"]) == 0
    captured = capsys.readouterr()
    assert (
        "warning: a_probes.jsonl: 2 lines ignored as no valid probe record (line 5: not a JSON object; "
        "line 8: frames -7): their files are probed again"
    ) in captured.err
    assert "probed 2 new or changed files, reused 18" in captured.out
    assert "-7" not in captured.out.replace(str(tmp_path), "<tmp>")  # pytest's folders are numbered: pytest-7
    assert outputs(out) == first

    older = [json.loads(line) for line in records_file.read_text().splitlines()]
    for record in older[1:-1]:
        del record["mode"]
    records_file.write_text("".join(json.dumps(r) + "\n" for r in older))
    assert "probed 0 new or changed files, reused 20" in annotate(capsys, src, out)
    records_file.write_text('{"make_annotations_probes": 1}\n')  # no folder in the header
    with pytest.raises(UserError, match=r"a_probes.jsonl is not a probe record file of this make_annotations"):
        main([str(src), "-o", str(out)])


def test_a_file_made_readable_is_probed_again(demo_clips, tmp_path, monkeypatch, capsys):
    """A file skipped as unreadable for its permissions is probed again once a chmod fixes
    them (its size and mtime stay the same; its mode is part of its record). The tests run
    as root, who reads any file: the probe is refused here as for another user."""
    src = tmp_path / "videos"
    src.mkdir()
    for name in ("a_0.mp4", "b_0.mp4", "c_0.mp4"):
        shutil.copy(sorted((demo_clips["root"] / "videos").glob("*.mp4"))[0], src / name)
    real_probe = probe_pool.probe_video

    def probe(path, threads=1):  # forked workers inherit this
        if not path.stat().st_mode & 0o444:
            raise BadClipError("unreadable", "Permission denied")
        return real_probe(path, threads)

    monkeypatch.setattr(probe_pool, "probe_video", probe)
    out, flags = tmp_path / "a.json", ("--val_fraction", "0.4")
    (src / "b_0.mp4").chmod(0)
    assert "b_0.mp4: unreadable: Permission denied" in annotate(capsys, src, out, *flags)
    (src / "b_0.mp4").chmod(0o644)
    assert "probed 1 new or changed files, reused 2" in annotate(capsys, src, out, *flags)
    assert read_list(tmp_path / "a_skipped.json") == []


def av1_mkv(path: Path, frames: int) -> Path:
    """A 64x48 AV1 clip (SVT-AV1) of ``frames`` grey levels 0, 40, 80, ..., in Matroska."""
    if "libsvtav1" not in av.codecs_available:
        pytest.skip("this PyAV has no AV1 encoder (libsvtav1)")
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libsvtav1", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 40 * i, np.uint8), "rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


@pytest.mark.slow  # a process of the tool
def test_av1_clips_opencv_cannot_decode_are_decoded_through_pyav(demo_clips, tmp_path, monkeypatch):
    """OpenCV's FFmpeg (opencv-python) decodes no AV1 frame; the tool keeps the clip with
    the frames PyAV decodes, without FFmpeg's lines on stderr, and training reads it."""
    monkeypatch.setenv("SVT_LOG", "1")  # the encoder's banner
    src = clip_folder(demo_clips, tmp_path / "videos", count=1)
    av1_mkv(src / "av1.mkv", 6)
    out = tmp_path / "a.json"
    result = run_cli(str(src), "-o", str(out), "--group_regex", "", "--val_fraction", "0.5")
    assert result.returncode == 0, result.stderr
    assert "[av1 @" not in result.stderr and "skipped 0" in result.stdout
    (entry,) = [
        e for e in read_list(tmp_path / "a_train.json") + read_list(tmp_path / "a_val.json") if "av1" in e["path"]
    ]
    assert (entry["frames"], entry["width"], entry["height"], entry["fps"]) == (6, 64, 48, 10.0)

    annotation = tmp_path / "av1.json"
    write_annotation(annotation, [entry])
    ds = VideoClipDataset(annotation_file=annotation, n_frames=3, height=48, width=64, mode="val", stride_range=(1, 1))
    frames = ds.load_clip(0).numpy()  # the middle window: frames 1, 2, 3
    assert np.abs(frames.mean(axis=(1, 2, 3)) - [40, 80, 120]).max() < 3


def documented_command(pattern: str) -> str:
    """The first match of ``pattern`` in docs/data.md."""
    match = re.search(pattern, (REPO_ROOT / "docs" / "data.md").read_text(), re.S | re.M)
    assert match, f"docs/data.md shows no command like {pattern!r}"
    return match.group(1)


@pytest.mark.slow  # processes of the tool
def test_the_documented_commands_run_from_any_folder(demo_clips, tmp_path):
    """docs/data.md's Slurm array job and merge, submitted from a folder that is not the
    repository; the tool run there by the installed package's Python, as the docs say, and
    the command its split warning prints, run there as it is printed."""
    src = tmp_path / "videos"
    src.mkdir()
    for name, clip in zip(("a_0.mp4", "b_0.mp4", "c_0.mp4"), sorted((demo_clips["root"] / "videos").glob("*.mp4"))):
        (src / name).symlink_to(clip)
    out = tmp_path / "slurm" / "annotations.json"

    def run(command: str, **env: str) -> subprocess.CompletedProcess:
        for doc, here in (("/path/to/taehv-train", REPO_ROOT), ("/data/videos", src), ("/data/annotations.json", out)):
            command = command.replace(doc, str(here))
        environment = {**os.environ, **env}
        environment.pop("PYTHONPATH", None)
        return subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120
        )

    script = documented_command(r"```bash\n(#!/bin/bash\n#SBATCH --job-name=annotate\n.*?)```")
    for task in (1, 2):
        job = run(script, SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_TASK_COUNT="2", SLURM_CPUS_PER_TASK="1")
        assert job.returncode == 0, job.stderr
    merged = run(documented_command(r'--wrap \\\n\s*"(.*?)"'))  # 0.05 of 3 clips holds none out: exit 1
    assert merged.returncode == 1 and "merged 2 probe parts: 3 videos" in merged.stdout, merged.stderr

    plain = run(
        documented_command(r"^(\S+ -m taehv_train\.training\.make_annotations videos [^\n]*)$")
    )  # relative paths
    assert plain.returncode == 1 and "found 3 videos" in plain.stdout, plain.stderr
    fix = plain.stderr.split("to fix it, run: ")[1].strip()
    assert fix.startswith(f"{sys.executable} -m taehv_train.training.make_annotations videos -o annotations.json")
    fixed = run(fix)
    assert fixed.returncode == 0, fixed.stderr
    assert len(read_list(tmp_path / "annotations_val.json")) == 1
