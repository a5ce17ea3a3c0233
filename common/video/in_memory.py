"""Frames held in memory behind ``VideoReader``'s interface: a whole video decoded once and
downscaled (``VideoClipDataset``'s frame cache), and image files, still or animated."""

from __future__ import annotations

import sys
from collections.abc import Callable

import cv2
import numpy as np

from taehv_train.common.video.files import BadClipError, Clip, ClipBytes, check_openable, opencv_failure
from taehv_train.common.video.reader import VideoReader
from taehv_train.common.video.resize import AreaResizer


class DecodedVideo:
    """A whole video decoded once, downscaled, and held in memory (``VideoClipDataset``'s
    frame cache); read like a ``VideoReader``."""

    def __init__(self, frames: np.ndarray):
        self.frames = frames  # (T, H, W, C) BGR or BGRA uint8: every frame that decodes

    @classmethod
    def decode(cls, path: Clip, scale_for: Callable[[int, int], float], threads: int = 1) -> DecodedVideo:
        """Every decodable frame of ``path``, area-resized by ``scale_for(height, width)`` of
        the first frame (at most 1); raises BadClipError as ``VideoReader`` does."""
        resize: AreaResizer | None = None

        def shrink(frame: np.ndarray, _: int) -> np.ndarray:
            nonlocal resize
            if resize is None:  # the first frame's size fixes the scale
                scale = min(1.0, scale_for(*frame.shape[:2]))
                resize = AreaResizer(max(1, round(frame.shape[1] * scale)), max(1, round(frame.shape[0] * scale)))
            return resize(frame)

        with VideoReader(path, threads=threads) as reader:
            frames, _ = reader.read(0, 1, sys.maxsize, shrink)  # to the end of the stream
        return cls(np.stack(frames) if frames else np.empty((0, 0, 0, 3), np.uint8))

    def __enter__(self) -> DecodedVideo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        pass

    @property
    def container_frame_count(self) -> int:
        return len(self.frames)

    def read(
        self, start: int, stride: int, count: int, transform: Callable[[np.ndarray, int], np.ndarray] | None = None
    ) -> tuple[list[np.ndarray], int | None]:
        """As ``VideoReader.read``: ``(frames, None)``, or the frames read and the true length."""
        out = []
        for k in range(count):
            index = start + k * stride
            if index >= len(self.frames):
                return out, len(self.frames)
            out.append(self.frames[index] if transform is None else transform(self.frames[index], k))
        return out, None

    def count_frames(self) -> int:
        return len(self.frames)


class ImageReader(DecodedVideo):
    """An image file behind ``VideoReader``'s interface: a still image is a one-frame clip,
    an animated one (WebP, APNG) a clip of all its frames, at the rate its frame durations
    give. Frames keep their alpha channel when they have one (BGRA); grey images come as
    BGR and 16-bit ones as 8 bits, as video frames do."""

    fps = 0.0  # a still image has no frame rate

    def __init__(self, path: Clip, **_: object):
        check_openable(path)
        frames, durations_ms = _image_frames(path)
        super().__init__(np.stack([_as_8_bit_bgr(frame) for frame in frames]))
        self.path = path
        if len(frames) > 1 and sum(durations_ms) > 0:
            self.fps = 1000 * len(durations_ms) / sum(durations_ms)

    @property
    def size(self) -> tuple[int, int]:
        return self.frames.shape[2], self.frames.shape[1]


def _image_frames(path: Clip) -> tuple[list[np.ndarray], list[int]]:
    """The frames of an image file (or its bytes) as OpenCV decodes them (``IMREAD_UNCHANGED``),
    all of an animation's, and their durations in ms (empty for a still image, read with ``imread``)."""
    try:
        if isinstance(path, ClipBytes):
            buffer = np.frombuffer(path.data, np.uint8)
            ok, animation = cv2.imdecodeanimation(buffer)
            if ok and animation.frames:
                return list(animation.frames), [int(d) for d in animation.durations]
            image = cv2.imdecode(buffer, cv2.IMREAD_UNCHANGED)
        else:
            ok, animation = cv2.imreadanimation(path)
            if ok and animation.frames:
                return list(animation.frames), [int(d) for d in animation.durations]
            image = cv2.imread(path, cv2.IMREAD_UNCHANGED)  # raises where imreadanimation only logged why
    except cv2.error as err:
        raise opencv_failure(err) from err
    if image is None:
        raise BadClipError("unreadable", "not an image OpenCV decodes, or truncated")
    return [image], []


def _as_8_bit_bgr(image: np.ndarray) -> np.ndarray:
    if image.dtype != np.uint8:  # 16-bit PNGs: the 8 bits the clips of videos have
        image = (image // 257).astype(np.uint8)
    return cv2.cvtColor(image, cv2.COLOR_GRAY2BGR) if image.ndim == 2 else image
