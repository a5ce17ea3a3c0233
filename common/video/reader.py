"""``VideoReader``: one video opened with OpenCV's FFmpeg backend and read forward, seeking
only where a seek beats reading on; PyAV decodes the files OpenCV opens but decodes no frame of."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import cv2
import numpy as np

from taehv_train.common.video.files import (
    BadClipError,
    Clip,
    check_openable,
    openable,
    opencv_failure,
    why_not_a_video,
)

if TYPE_CHECKING:
    from taehv_train.common.video.pyav_stream import PyAVStream

logger = logging.getLogger(__name__)

# FFmpeg's own lines from inside OpenCV ("[av1 @ 0x...] Failed to get pixel format", "moov
# atom not found") go straight to stderr, once per file; what they tell of reaches the user
# as a BadClipError reason instead. OpenCV reads this when it opens its first video; a
# level the user set wins (16 shows FFmpeg's errors again).
os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "8")  # AV_LOG_FATAL
# OpenCV's own "[ WARN:0@...] ... VIDEOIO(FFMPEG): backend is generally available but can't
# be used to capture by name", once per file it cannot open (damaged, truncated, replaced
# mid-run): the failure reaches the user as the counted, logged skip of the clip instead.
# Errors still show, and a level the user set in OPENCV_LOG_LEVEL wins.
if "OPENCV_LOG_LEVEL" not in os.environ:
    cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_ERROR)


class VideoReader:
    """One opened video, read forward; seeks only when that beats reading on.

    OpenCV's FFmpeg backend picks the best video stream wherever it stands among the
    file's streams (an audio stream may come first) and converts full-range yuvj420p
    correctly. ``grab()`` decodes without the colour conversion, so frames skipped by the
    stride cost only their decode.
    A seek decodes from the previous keyframe, so it pays off only for jumps of at least
    ``seek_threshold`` frames; it is verified against the decoder's frame position, and a
    seek that lands elsewhere is replaced by reading on from the start.
    A file OpenCV opens but decodes no frame of (AV1 in the opencv-python wheels, whose
    FFmpeg decodes AV1 only in hardware) is decoded through PyAV instead (``PyAVStream``,
    libdav1d), read forward without seeking; the size, frame rate and count are OpenCV's.
    """

    def __init__(self, path: Clip, *, seek_threshold: int = 32, threads: int = 1):
        self.path = path
        self.seek_threshold = seek_threshold
        self.threads = threads
        self._pyav = False  # decoding through PyAV: OpenCV's FFmpeg gave no frame of the file
        self._cap = self._open()
        self._pos = 0  # index of the frame the next read() returns
        count = self._cap.get(cv2.CAP_PROP_FRAME_COUNT)
        # What the container claims, or -1 where it claims no positive count (FFmpeg reads a
        # still image named like a video with a count of -2**63); it may exceed the frames
        # that decode.
        self.container_frame_count = int(count) if math.isfinite(count) and count >= 1 else -1
        self.fps = float(self._cap.get(cv2.CAP_PROP_FPS))
        # (width, height) of the decoded frames
        self.size = int(self._cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(self._cap.get(cv2.CAP_PROP_FRAME_HEIGHT))

    def _open(self) -> cv2.VideoCapture | PyAVStream:
        check_openable(self.path)
        if self._pyav:
            from taehv_train.common.video.pyav_stream import (  # PyAV only for the files that need it
                PyAVOpenError,
                PyAVStream,
            )

            try:
                return PyAVStream(openable(self.path), self.threads)
            except PyAVOpenError as err:
                raise BadClipError("unreadable", str(err)) from err
        try:
            # the capture reads a file object through Python without holding it: keep it here
            self._source = openable(self.path)
            cap = cv2.VideoCapture(self._source, cv2.CAP_FFMPEG, [cv2.CAP_PROP_N_THREADS, self.threads])
        except cv2.error as err:
            raise opencv_failure(err) from err
        if not cap.isOpened() or min(cap.get(cv2.CAP_PROP_FRAME_WIDTH), cap.get(cv2.CAP_PROP_FRAME_HEIGHT)) <= 0:
            cap.release()
            raise why_not_a_video(self.path)
        return cap

    def _restart(self) -> None:
        self._cap.release()
        self._cap = self._open()
        self._pos = 0

    def _through_pyav(self) -> bool:
        """Whether OpenCV's capture, which has given no frame, was replaced by PyAV's decoder
        (once per reader: a stream neither decodes has no frames)."""
        if self._pyav or self._pos > 0:
            return False
        self._cap.release()
        self._pyav = True
        self._cap = self._open()
        logger.debug("OpenCV decodes no frame of %s: decoding it through PyAV", self.path)
        return True

    def _grab(self) -> bool:
        return self._cap.grab() or (self._through_pyav() and self._cap.grab())

    def _read(self) -> tuple[bool, np.ndarray | None]:
        ok, frame = self._cap.read()
        if not ok and self._through_pyav():
            ok, frame = self._cap.read()
        return ok, frame

    def __enter__(self) -> VideoReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._cap.release()

    def seek(self, target: int) -> bool:
        """Jump so that the next read returns frame ``target`` (OpenCV's decoder only: ``read``
        seeks when the jump pays off); True if the decoder landed there, else False with the
        reader back at frame 0."""
        if self._cap.set(cv2.CAP_PROP_POS_FRAMES, target) and int(self._cap.get(cv2.CAP_PROP_POS_FRAMES)) == target:
            self._pos = target
            return True
        logger.debug("seek to frame %d of %s did not land there; reading on from the start", target, self.path)
        self._restart()
        return False

    def _skip_to(self, target: int) -> bool:
        """Position so that the next read returns frame ``target``; False if the stream ends first."""
        jump = target < self._pos or target - self._pos >= self.seek_threshold
        if not self._pyav and target >= self.seek_threshold and jump and self.seek(target):
            return True
        if target < self._pos:
            self._restart()
        while self._pos < target:
            if not self._grab():
                return False
            self._pos += 1
        return True

    def read(
        self, start: int, stride: int, count: int, transform: Callable[[np.ndarray, int], np.ndarray] | None = None
    ) -> tuple[list[np.ndarray], int | None]:
        """Frames ``start, start + stride, ...`` (BGR, or ``transform(frame, k)`` of the k-th).

        Returns ``(frames, None)`` when all ``count`` frames decoded, else the frames read
        so far and the number of frames the stream actually decodes (its true length).
        """
        frames = []
        for k in range(count):
            if not self._skip_to(start + k * stride):
                return frames, self._pos
            ok, frame = self._read()
            if not ok:
                return frames, self._pos
            self._pos += 1
            frames.append(frame if transform is None else transform(frame, k))
        return frames, None

    def count_frames(self) -> int:
        """Decode to the end (no colour conversion); the number of frames that decode."""
        while self._grab():
            self._pos += 1
        return self._pos
