"""The shared clips as the users' data: centre-cropped to the output's aspect, area-resized
and re-encoded as H.264 with a keyframe every 30 frames (as dash cameras write them), for
benchmarks of the loader and of the training it feeds.

    entries = reencode_clips(videos_dir, out_dir, 720, 480)   # [{"path": "x.mp4", "frames": 200}, ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import cv2
import numpy as np

from taehv_train.common.video.crop import crop_box
from taehv_train.common.video.files import find_videos
from taehv_train.common.video.reader import VideoReader
from taehv_train.common.video.resize import AreaResizer
from taehv_train.common.video.writer import write_video

DASH_CAMERA_GOP = 30


def reencode_clip(source: Path, target: Path, width: int, height: int, max_frames: int | None = None) -> int:
    """The centred crop of ``source`` with the output's aspect, area-resized to ``width x
    height``, written to ``target`` as H.264; returns the frames written."""
    with VideoReader(str(source)) as reader:
        src_w, src_h = reader.size
        y, x, h, w = crop_box(src_h, src_w, height, width)
        resize = AreaResizer(width, height)

        def rgb(frame: np.ndarray, _: int) -> np.ndarray:
            return cv2.cvtColor(resize(frame[y : y + h, x : x + w]), cv2.COLOR_BGR2RGB)

        frames, _ = reader.read(0, 1, max_frames or sys.maxsize, rgb)
        fps = reader.fps
    codec = write_video(target, np.stack(frames), fps, keyframe_interval=DASH_CAMERA_GOP)
    if codec != "h264":
        raise RuntimeError(f"{target} was written as {codec}, not H.264: this PyAV has no libx264")
    return len(frames)


def reencode_clips(
    videos_dir: Path, out_dir: Path, width: int, height: int, clips: int | None = None, max_frames: int | None = None
) -> list[dict]:
    """The first ``clips`` videos of ``videos_dir`` (all by default) re-encoded into
    ``out_dir`` (``reencode_clip``); their annotation entries, paths relative to ``out_dir``."""
    names = find_videos(videos_dir)[:clips]
    if not names:
        raise FileNotFoundError(f"no videos in {videos_dir}")
    entries = []
    for name in names:
        target = Path(name).with_suffix(".mp4")
        frames = reencode_clip(videos_dir / name, out_dir / target, width, height, max_frames)
        entries.append({"path": str(target), "frames": frames})
    return entries
