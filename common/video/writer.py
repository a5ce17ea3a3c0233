"""Writing videos that browsers play (H.264 via PyAV): the evaluation's comparison videos and
the built-in demo clips."""

from __future__ import annotations

import logging
from fractions import Fraction
from pathlib import Path

import cv2
import numpy as np

from taehv_train.base.atomic import atomic_write

logger = logging.getLogger(__name__)


def _even(frames: np.ndarray) -> np.ndarray:
    """H.264 with yuv420p needs even sizes: pad one row/column by edge replication."""
    _, h, w, _ = frames.shape
    return np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")


def write_video(path: Path, frames: np.ndarray, fps: float, keyframe_interval: int | None = None) -> str:
    """Write THWC uint8 RGB frames; H.264 (yuv420p) when PyAV has libx264, else mp4v with a
    warning (mp4v plays in desktop players but not in browsers). Returns the codec used.
    ``keyframe_interval``: the H.264 GOP length (a loader's seeks decode from the keyframe
    before their target); libx264's default when None. Written atomically (``base.atomic``)."""
    import av

    frames = _even(frames)
    if "libx264" in av.codecs_available:
        atomic_write(path, lambda tmp: _write_h264(tmp, frames, fps, keyframe_interval))
        return "h264"
    logger.warning("PyAV has no libx264 here: writing %s as mp4v, which browsers cannot play", path.name)
    atomic_write(path, lambda tmp: _write_mp4v(tmp, frames, fps))
    return "mp4v"


def _write_h264(path: Path, frames: np.ndarray, fps: float, keyframe_interval: int | None) -> None:
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {
            "crf": "18",
            "preset": "veryfast",
            **({} if keyframe_interval is None else {"g": str(keyframe_interval)}),
        }
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _write_mp4v(path: Path, frames: np.ndarray, fps: float) -> None:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (frames.shape[2], frames.shape[1]))
    for frame in frames:
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    writer.release()
