"""Annotation files and data folders: written atomically (a full disk leaves the former files
whole), parsed and checked before any run folder exists (one line naming the file and the
entry, in training and in ``inference.py``), implausible frame counts refused by entry,
folders whose clips can give no sample refused in pre-flight, the note on a split that
holds out clip by clip, and OpenCV's own warnings kept off stderr."""

from __future__ import annotations

import builtins
import errno
import json
import runpy
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from test_launch_script import launch

from conftest import tool_exit
from taehv_train.base.atomic import TMP_PREFIX
from taehv_train.base.errors import UserError
from taehv_train.models.taehv import TAEHV
from taehv_train.models.weights import save_weights
from taehv_train.training import make_annotations, own_data
from taehv_train.training import taehv_train as training
from train_runs import REPO_ROOT, TEST_CONFIG, train_here, training_options

INFERENCE = str(REPO_ROOT / "inference.py")


def link_clips(demo_clips: dict[str, Path], folder: Path, count: int) -> Path:
    """``folder`` with links to ``count`` of the demo clips."""
    folder.mkdir(parents=True, exist_ok=True)
    for clip in sorted((demo_clips["root"] / "videos").glob("*.mp4"))[:count]:
        (folder / clip.name).symlink_to(clip)
    return folder


def test_a_full_disk_while_annotating_leaves_the_former_files_byte_identical(demo_clips, tmp_path, monkeypatch, capsys):
    folder = link_clips(demo_clips, tmp_path / "videos", count=2)
    out = tmp_path / "ann" / "annotations.json"
    args = (str(folder), "-o", str(out), "--val_fraction", "0")
    assert tool_exit(capsys, make_annotations._exit_with_status, *args)[0] == 0
    written = {p.name: p.read_bytes() for p in out.parent.glob("annotations_*.json")}
    assert set(written) == {"annotations_train.json", "annotations_val.json", "annotations_skipped.json"}

    (folder / "clip_00002.mp4").symlink_to(demo_clips["root"] / "videos" / "clip_00002.mp4")  # a re-run has news
    real_open = builtins.open

    class FullDisk:
        """A file on a disk that fills up half-way through the first write."""

        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            self.file.write(data[: len(data) // 2])
            self.file.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    def open_on_a_full_disk(file, mode="r", *rest, **options):
        opened = real_open(file, mode, *rest, **options)
        # the val file, written after the train file: neither may change
        return FullDisk(opened) if "w" in mode and str(file).endswith("_val.json") else opened

    monkeypatch.setattr(builtins, "open", open_on_a_full_disk)
    status, _, err = tool_exit(capsys, make_annotations._exit_with_status, *args)
    monkeypatch.undo()
    errors = [line for line in err if "error" in line.lower()]  # the rest is the progress bar
    assert status == 2 and len(errors) == 1 and "Traceback" not in "\n".join(err), err
    assert errors[0].startswith("error: cannot write the annotations next to"), errors
    assert "No space left on device" in errors[0]
    assert {p.name: p.read_bytes() for p in out.parent.glob("annotations_*.json")} == written
    assert not list(out.parent.glob(TMP_PREFIX + "*"))  # the partial files gave their space back


MALFORMED = {
    "truncated": (b'{"total": 2, "list": [\n{"path": "videos/clip_00000.mp4", "fra', "is no valid JSON"),
    "a list": (b"[]", "holds a list, not an object"),
    "no list": (b'{"total": 0}', "has no 'list' of clips"),
    "list a number": (b'{"list": 5}', "'list' is a number, not a list of clips"),
    "entry not an object": (b'{"list": [{"path": "videos/clip_00000.mp4"}, 7]}', "entry 1 is a number"),
    "binary": (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "is not UTF-8 text"),
    "no path": (b'{"list": [{"path": "videos/clip_00000.mp4"}, {"frames": 12}]}', "entry 1 has neither 'path'"),
    "path of a wrong type": (
        b'{"list": [{"path": "videos/clip_00000.mp4", "full_path": ["x"]}]}',
        'entry 0 (videos/clip_00000.mp4) has full_path=["x"], not a file path',
    ),
}


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return save_weights(TAEHV(variant="taecvx"), tmp_path_factory.mktemp("model") / "final_model.safetensors")


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_annotation_file_is_one_line_naming_it_in_training_and_inference(
    case, demo_clips, weights, tmp_path, monkeypatch, capsys
):
    content, message = MALFORMED[case]
    annotation = tmp_path / "bad.json"
    annotation.write_bytes(content)
    data = {**demo_clips, "train": annotation}
    with pytest.raises(UserError) as refused:  # pre-flight: before any run folder
        training.main(training_options(tmp_path / "out", data))
    assert message in str(refused.value) and str(annotation) in str(refused.value)
    assert "\n" not in str(refused.value) and not (tmp_path / "out").exists()

    evaluate = [
        "--model_path",
        str(weights),
        "--annotation_file",
        str(annotation),
        "--data_root",
        str(demo_clips["root"]),
    ]
    monkeypatch.setattr(sys, "argv", [INFERENCE, *evaluate, "--n_frames", "5", "--output_dir", str(tmp_path / "eval")])
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(INFERENCE, run_name="__main__")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    error = err[err.index("error: ") :].rstrip()
    assert "\n" not in error and message in error and str(annotation) in error


@pytest.mark.parametrize(
    "entries, message",
    [
        ([], "no clips in"),
        (
            [{"path": "videos/clip_00000.mp4", "frames": -1}],
            "no clips in .* \\(1 entries refused, e.g. entry 0: frames",
        ),
        ([{"path": "videos/clip_00000.mp4", "frames": 3}], "all 1 clips in .* have fewer than the 9 frames"),
    ],
)
def test_clips_that_can_give_no_sample_are_refused_before_a_run_folder_exists(entries, message, demo_clips, tmp_path):
    annotation = tmp_path / "few.json"
    annotation.write_text(json.dumps({"list": entries}))
    with pytest.raises(UserError, match=message) as refused:
        training.main(training_options(tmp_path / "out", {**demo_clips, "train": annotation}))
    assert "--min_frames" not in str(refused.value) and not (tmp_path / "out").exists()


@pytest.mark.slow  # a training run
def test_a_clip_damaged_mid_run_is_counted_without_opencv_lines_and_an_absurd_frame_count_is_refused(
    demo_clips, tmp_path, capfd
):
    """A clip that cannot be opened is skipped, counted and logged by us, while OpenCV's own
    ``[ WARN ]`` line stays off stderr; an entry of 3e9 frames (more than int32) is left out
    with a warning naming it, as any implausible count."""
    damaged = tmp_path / "damaged.mp4"
    whole = (demo_clips["root"] / "videos" / "clip_00000.mp4").read_bytes()
    damaged.write_bytes(whole[: len(whole) // 2])
    entries = json.loads(Path(demo_clips["train"]).read_text())["list"]
    entries += [
        {"full_path": str(damaged), "frames": 12},
        {"path": "videos/clip_00001.mp4", "frames": 3_000_000_000},
    ]
    annotation = tmp_path / "train.json"
    annotation.write_text(json.dumps({"list": entries}))
    capfd.readouterr()
    run = train_here(
        tmp_path / "out", {**demo_clips, "train": annotation}, "--max_failure_fraction=0.9", "--max_train_steps=2"
    )
    err = capfd.readouterr().err
    assert "[ WARN" not in err and "VIDEOIO" not in err, err[-3000:]
    log = (run / "train.log").read_text()
    assert f"({damaged}) skipped: unreadable" in log
    assert (
        f"entry {len(entries) - 1}: frames=3000000000 is more than any clip holds (at most {np.iinfo(np.int32).max})"
        in log
    )


@pytest.mark.slow  # the launch script's processes
def test_a_data_folder_of_still_images_is_refused_before_training_and_names_the_video_formats(tmp_path):
    images = tmp_path / "stills"
    images.mkdir()
    for i in range(3):
        cv2.imwrite(str(images / f"still_{i}.png"), np.full((32, 32, 3), 40 * i, np.uint8))
    out = tmp_path / "out"
    result = launch("1", "test", f"--data={images}", f"--output_dir={out}")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    error = next(line for line in result.stderr.splitlines() if "error: " in line)
    assert "lists no videos, only 3 still images (one frame each)" in error and ".mp4" in error, error
    assert "--min_frames" not in result.stdout + result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["annotations"]  # no run folder


def test_a_split_clip_by_clip_says_why_for_two_camera_folders(demo_clips, tmp_path, capsys):
    folder = tmp_path / "cameras"
    for camera in ("a", "b"):
        link_clips(demo_clips, folder / camera, count=3)
    overrides = tmp_path / "overrides.txt"
    own_data.main(
        [str(folder), "--config", TEST_CONFIG, "--overrides_file", str(overrides), f"--output_dir={tmp_path}"]
    )
    note = next(line for line in capsys.readouterr().out.splitlines() if "held out file by file" in line)
    assert "one source" not in note
    assert "the smallest of the 2 groups, 'a/clip', has 3 of the 6 clips" in note, note
    assert any(
        line.startswith("--val_annotation_file=") and line.endswith("_val.json")
        for line in overrides.read_text().splitlines()
    )
