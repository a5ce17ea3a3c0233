"""Video clip dataset for TAEHV training and evaluation: annotation or folder in, uint8 clips out.

Each sample is ``{"frames": uint8 [T, C, H, W], "index": int, "failures": int}``: RGB (C = 3),
or RGBA (C = 4) for a TAE with 4 image channels. A still image (PNG, WebP) is a one-frame
clip and an animated one a clip of all its frames, with their alpha for RGBA (dropped for
RGB); a video's frames are opaque.
``index`` is the clip actually used (a bad clip is replaced by another one) and
``failures`` counts the clips that had to be replaced while producing the sample, so the
training loop can sum it over batches even when samples come from worker processes.
Normalisation to [0, 1] happens on the device in the training loop, not here.

Sampling is a pure function of ``(seed, epoch, index)``: a resumed run, a different
worker count or Accelerate's rank sharding all see the same clips for the same indices.
See docs/data.md for the policies (short clips, bad files, seeking) and how to point
training at real videos.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from common.errors import UserError
from common.packet_count import count_frames_from_packets

if TYPE_CHECKING:
    from common.pyav_stream import PyAVStream

logger = logging.getLogger(__name__)

# FFmpeg's own lines from inside OpenCV ("[av1 @ 0x...] Failed to get pixel format", "moov
# atom not found") go straight to stderr, once per file; what they tell of reaches the user
# as a BadClipError reason instead. OpenCV reads this when it opens its first video; a
# level the user set wins (16 shows FFmpeg's errors again).
os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "8")  # AV_LOG_FATAL

VIDEO_EXTENSIONS = (".mp4", ".avi", ".mov", ".mkv", ".webm")
IMAGE_EXTENSIONS = (".png", ".webp")  # images, read with their alpha channel: one frame, or an animation's frames
ShortClipPolicy = Literal["lower_stride", "skip"]


class VideoDataError(UserError):
    """The data cannot feed training (empty, too many bad files); the message says what to do
    (a user's problem: one line and exit status 2 from the command-line tools)."""


class BadClipError(Exception):
    """One clip cannot produce a sample; the dataset counts it and uses another clip.

    ``kind`` is a short category ("missing", "unreadable", ...) used to summarise reports.
    """

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


def frames_to_unit(
    frames: torch.Tensor, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 frames as the dataset delivers them -> ``dtype`` in [0, 1] on ``device``: the one
    normalisation used by training, validation, the latent cache and inference."""
    return frames.to(device, non_blocking=True).to(dtype).div_(255)


def clip_extensions(images: bool = False) -> tuple[str, ...]:
    """What a folder is scanned for: videos, and with ``images`` still images too."""
    return VIDEO_EXTENSIONS + IMAGE_EXTENSIONS if images else VIDEO_EXTENSIONS


def find_videos(directory: str | Path, images: bool = False) -> list[str]:
    """Video files under ``directory`` (recursive), and still images with ``images``, as
    sorted POSIX paths relative to it.

    Everything with such a name that is not a folder is listed, FIFOs, sockets and devices
    included: the readers refuse those unopened (``BadClipError("not a regular file")``), so
    the caller reports them with the other unusable clips instead of dropping them unseen.
    """
    directory = Path(directory)
    extensions = clip_extensions(images)
    return sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.suffix.lower() in extensions and not p.is_dir()
    )


def holds_clips(directory: str | Path, images: bool = True) -> bool:
    """Whether ``directory`` holds at least one video (or image) anywhere below it; stops at
    the first, so a folder of a million clips answers at once."""
    extensions = clip_extensions(images)
    return any(p.suffix.lower() in extensions and not p.is_dir() for p in Path(directory).rglob("*"))


# ----------------------------------------------------------------------------------------
# Compact clip table (shared by forked DataLoader workers without copy-on-access)
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClipTable:
    """Paths and frame counts of all clips as three numpy arrays.

    A list of millions of dicts would be copied page by page into every forked worker as
    reference counts change; flat arrays are never written to, so workers share them.
    ``frames`` is -1 where unknown (the container's count is used at load time).
    """

    root: str
    path_bytes: np.ndarray  # uint8, all paths UTF-8 encoded back to back
    offsets: np.ndarray  # int64, len(table) + 1
    frames: np.ndarray  # int32
    refused: tuple[tuple[str, str], ...] = ()  # annotation entries left out: (path as written, why)

    @classmethod
    def from_lists(
        cls, root: str | Path, paths: Sequence[str], frames: Sequence[int], refused: Sequence[tuple[str, str]] = ()
    ) -> ClipTable:
        encoded = [p.encode("utf-8") for p in paths]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        path_bytes = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        return cls(str(root), path_bytes, offsets, np.asarray(frames, dtype=np.int32), tuple(refused))

    @classmethod
    def from_directory(cls, directory: str | Path, images: bool = False) -> ClipTable:
        """All videos (and with ``images`` still images) under ``directory``, frame counts
        unknown (read from the container)."""
        paths = find_videos(directory, images)
        return cls.from_lists(directory, paths, [-1] * len(paths))

    @classmethod
    def from_annotation(cls, annotation_file: str | Path, data_root: str | Path | None = None) -> ClipTable:
        """Users' format ``{"total": N, "list": [{"path" | "full_path", "frames", ...}]}``.

        With ``data_root``, ``path`` is taken relative to it (``full_path`` when there is
        no ``path``); without, ``full_path`` wins and ``path`` is relative to the
        annotation file's folder. Absolute paths are used as they are. An entry whose
        ``frames`` is not a positive whole number (missing or null: the container says), or
        whose relative path leaves the root (``../../etc/passwd``), is left out and listed
        in ``refused``.
        """
        annotation_file = Path(annotation_file)
        with open(annotation_file, encoding="utf-8") as f:
            entries = json.load(f)["list"]
        if data_root is not None:
            keys = ("path", "full_path")
            root = str(data_root)
        else:
            keys = ("full_path", "path")
            root = str(annotation_file.resolve().parent)
        paths, frames, refused = [], [], []
        for i, entry in enumerate(entries):
            key = next((k for k in keys if k in entry), None)
            if key is None:
                raise ValueError(f"{annotation_file}: entry {i} has neither 'path' nor 'full_path'")
            path, count = str(entry[key]), entry.get("frames")
            if isinstance(count, float) and count.is_integer():
                count = int(count)
            if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
                refused.append((path, f"entry {i}: frames={count!r} is not a positive whole number"))
            elif not os.path.isabs(path) and os.path.normpath(path).split(os.sep)[0] == os.pardir:
                refused.append((path, f"entry {i}: {path} leaves {root}"))
            else:
                paths.append(path)
                frames.append(-1 if count is None else count)  # missing/null: ask the container
        return cls.from_lists(root, paths, frames, refused)

    def __len__(self) -> int:
        return len(self.frames)

    def subset(self, indices: Sequence[int]) -> ClipTable:
        """The clips at ``indices``, in that order."""
        relative = [self.path_bytes[self.offsets[i] : self.offsets[i + 1]].tobytes().decode("utf-8") for i in indices]
        return ClipTable.from_lists(self.root, relative, self.frames[np.asarray(indices, dtype=np.int64)])

    def path(self, i: int) -> str:
        rel = self.path_bytes[self.offsets[i] : self.offsets[i + 1]].tobytes().decode("utf-8")
        return os.path.join(self.root, rel)


# ----------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------

_SPECIAL_FILES = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a folder"),
)


def special_file_kind(path: str | Path) -> str | None:
    """What ``path`` is when it is not a regular file (``"a FIFO (named pipe)"``, a socket,
    a device, a folder), else None; from ``os.stat`` (links followed), which never blocks,
    whereas opening a FIFO waits for a writer forever. Raises OSError as ``os.stat`` does."""
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _SPECIAL_FILES if test(mode)), "another kind of file")


def check_regular_file(path: str | Path) -> None:
    """Raise BadClipError unless ``path`` is a regular file (or a link to one): "missing", or
    "not a regular file" for a FIFO, socket, device or folder, decided before anything opens
    it; a file ``stat`` cannot reach for another reason (permissions, a link loop) is
    "unreadable"."""
    try:
        kind = special_file_kind(path)
    except (FileNotFoundError, NotADirectoryError):
        raise BadClipError("missing") from None
    except OSError as err:
        raise BadClipError("unreadable", err.strerror or str(err)) from err
    if kind is not None:
        raise BadClipError("not a regular file", kind)


def opencv_failure(err: cv2.error) -> BadClipError:
    """The BadClipError for an OpenCV exception raised while reading a file (an image whose
    header claims more pixels than OpenCV decodes raises rather than returning None)."""
    if "CV_IO_MAX_IMAGE_PIXELS" in str(err):
        return BadClipError("too large", "its header claims more pixels than OpenCV reads (CV_IO_MAX_IMAGE_PIXELS)")
    return BadClipError("unreadable", f"OpenCV: {getattr(err, 'err', '') or str(err).strip().splitlines()[-1]}")


def why_not_a_video(path: str) -> BadClipError:
    """Why OpenCV cannot open ``path`` as a video, from the streams PyAV finds in it: none is
    a video stream (an audio-only MP4), or the file is no container FFmpeg reads, or its
    video stream does not decode."""
    import av  # only for files OpenCV cannot open

    try:
        with av.open(path) as container:
            kinds = sorted({stream.type for stream in container.streams})
    except av.FFmpegError:
        return BadClipError("unreadable", "not a video, unsupported codec or truncated container")
    if "video" not in kinds:
        return BadClipError(
            "no video stream", f"it has only {' and '.join(kinds)} streams" if kinds else "it has no streams"
        )
    return BadClipError("unreadable", "its video stream does not decode (unsupported codec or damaged)")


class VideoReader:
    """One opened video, read forward; seeks only when that beats reading on.

    OpenCV's FFmpeg backend picks the best video stream (the Udacity clips have audio as
    stream 0) and converts full-range yuvj420p correctly. ``grab()`` decodes without the
    colour conversion, so frames skipped by the stride cost only their decode.
    A seek decodes from the previous keyframe, so it pays off only for jumps of at least
    ``seek_threshold`` frames; it is verified against the decoder's frame position, and a
    seek that lands elsewhere is replaced by reading on from the start.
    A file OpenCV opens but decodes no frame of (AV1 in the opencv-python wheels, whose
    FFmpeg decodes AV1 only in hardware) is decoded through PyAV instead (``PyAVStream``,
    libdav1d), read forward without seeking; the size, frame rate and count are OpenCV's.
    """

    def __init__(self, path: str, *, seek_threshold: int = 32, threads: int = 1):
        self.path = path
        self.seek_threshold = seek_threshold
        self.threads = threads
        self._pyav = False  # decoding through PyAV: OpenCV's FFmpeg gave no frame of the file
        self._cap = self._open()
        self._pos = 0  # index of the frame the next read() returns
        count = self._cap.get(cv2.CAP_PROP_FRAME_COUNT)
        # What the container claims, or -1 where it claims no positive count (FFmpeg reads a
        # still image named like a video with a count of -2**63); may be wrong (the shadow
        # clip says 162, 160 decode).
        self.container_frame_count = int(count) if math.isfinite(count) and count >= 1 else -1
        self.fps = float(self._cap.get(cv2.CAP_PROP_FPS))
        # (width, height) of the decoded frames
        self.size = int(self._cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(self._cap.get(cv2.CAP_PROP_FRAME_HEIGHT))

    def _open(self) -> cv2.VideoCapture | PyAVStream:
        check_regular_file(self.path)
        if self._pyav:
            from common.pyav_stream import PyAVOpenError, PyAVStream  # PyAV only for the files that need it

            try:
                return PyAVStream(self.path, self.threads)
            except PyAVOpenError as err:
                raise BadClipError("unreadable", str(err)) from err
        try:
            cap = cv2.VideoCapture(self.path, cv2.CAP_FFMPEG, [cv2.CAP_PROP_N_THREADS, self.threads])
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

    def _seek(self, target: int) -> bool:
        if self._cap.set(cv2.CAP_PROP_POS_FRAMES, target) and int(self._cap.get(cv2.CAP_PROP_POS_FRAMES)) == target:
            self._pos = target
            return True
        logger.debug("seek to frame %d of %s did not land there; reading on from the start", target, self.path)
        self._restart()
        return False

    def _skip_to(self, target: int) -> bool:
        """Position so that the next read returns frame ``target``; False if the stream ends first."""
        jump = target < self._pos or target - self._pos >= self.seek_threshold
        if not self._pyav and target >= self.seek_threshold and jump and self._seek(target):
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


class DecodedVideo:
    """A whole video decoded once, downscaled, and held in memory (``VideoClipDataset``'s
    frame cache); read like a ``VideoReader``."""

    def __init__(self, frames: np.ndarray):
        self.frames = frames  # (T, H, W, C) BGR or BGRA uint8: every frame that decodes

    @classmethod
    def decode(cls, path: str, scale_for: Callable[[int, int], float], threads: int = 1) -> DecodedVideo:
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

    def __init__(self, path: str, **_: object):
        check_regular_file(path)
        frames, durations_ms = _image_frames(path)
        super().__init__(np.stack([_as_8_bit_bgr(frame) for frame in frames]))
        self.path = path
        if len(frames) > 1 and sum(durations_ms) > 0:
            self.fps = 1000 * len(durations_ms) / sum(durations_ms)

    @property
    def size(self) -> tuple[int, int]:
        return self.frames.shape[2], self.frames.shape[1]


def _image_frames(path: str) -> tuple[list[np.ndarray], list[int]]:
    """The frames of an image file as OpenCV decodes them (``IMREAD_UNCHANGED``), all of
    an animation's, and their durations in ms (empty for a still image, read with ``imread``)."""
    try:
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


def open_clip(path: str, **options: object) -> VideoReader | ImageReader:
    """The reader for ``path``: images by their extension, anything else as a video."""
    return (ImageReader if Path(path).suffix.lower() in IMAGE_EXTENSIONS else VideoReader)(path, **options)


@dataclass(frozen=True)
class VideoInfo:
    frames: int  # frames that actually decode
    fps: float
    width: int
    height: int


def probe_video(path: str | Path, threads: int = 1, exact_decode: bool = False) -> VideoInfo:
    """A video's (or image file's) true length, frame rate and size; raises BadClipError if
    unusable, without opening a FIFO, socket or device.

    The size and frame rate are OpenCV's; the length is the number of frames OpenCV's
    ``grab`` yields from frame 0 to the end. Of an H.264 or HEVC video it is counted from
    the packets when they prove it (``count_frames_from_packets``), which reads the file
    but decodes nothing; otherwise, or with ``exact_decode``, every frame is decoded.
    """
    with open_clip(str(path), threads=threads) as reader:
        fps, (width, height) = reader.fps, reader.size
        frames = None
        if isinstance(reader, VideoReader) and not exact_decode:
            frames = count_frames_from_packets(str(path), reader.container_frame_count).frames
        if frames is None:
            frames = reader.count_frames()
    if frames == 0:
        raise BadClipError("no decodable frames")
    return VideoInfo(frames=frames, fps=fps, width=width, height=height)


# ----------------------------------------------------------------------------------------
# Sampling geometry and frame conversion
# ----------------------------------------------------------------------------------------


def fit_stride(length: int, n_frames: int, stride: int, policy: ShortClipPolicy) -> int | None:
    """The stride to use for a clip of ``length`` decodable frames, or None to skip it.

    "lower_stride" lowers the stride to the largest one that fits; "skip" skips any clip
    too short for the drawn stride. Either way a clip shorter than ``n_frames`` is skipped.
    """
    if (n_frames - 1) * stride + 1 <= length:
        return stride
    if policy == "skip" or length < n_frames:
        return None
    return 1 if n_frames == 1 else (length - 1) // (n_frames - 1)


def crop_box(
    src_h: int, src_w: int, out_h: int, out_w: int, area: float = 1.0, u_y: float = 0.5, u_x: float = 0.5
) -> tuple[int, int, int, int]:
    """``(y, x, h, w)`` of a crop with the output's aspect ratio (not square).

    ``area`` is the fraction of the largest such crop that fits the source; ``u_y`` and
    ``u_x`` in [0, 1) place it (0.5 = centred).
    """
    aspect = out_w / out_h
    max_h = min(src_h, src_w / aspect)
    h = max(1, min(src_h, round(max_h * math.sqrt(area))))
    w = max(1, min(src_w, round(h * aspect)))
    y = min(int(u_y * (src_h - h + 1)), src_h - h)
    x = min(int(u_x * (src_w - w + 1)), src_w - w)
    return y, x, h, w


# OpenCV floors ``dst_index * src_size / dst_size`` in floating point; where the exact
# product is an integer it can land just below it and put a whole sub-box on the wrong
# source pixel (seen: errors up to 56 levels). Asking for scale factors this hair below
# the exact ones keeps every floor right; positions move by < 1e-5 pixels.
_AREA_SCALE_SHRINK = 1 - 1e-9


class AreaResizer:
    """Area (box-filter) resampling to exactly ``width x height``, for a stream of images.

    Equal to one ``cv2.INTER_AREA`` resize within 1 level (mean ~0.1), but up to 2x faster at
    non-integer downscale factors, where INTER_AREA runs scalar code (~4-5 ms for a 720p crop
    to 720x480). It chains two vectorised INTER_AREA paths that are both exact box filters:
    upscaling to ``k`` times the output (``k`` = the factor rounded up) cuts each output
    pixel's footprint into k x k equal sub-boxes, each smaller than a source pixel and so
    averaged exactly with 2 taps per axis; the integer k x k reduction then averages the
    sub-boxes. The only extra error is rounding the sub-box averages to uint8.

    The sub-box image (k^2 times the output, several MB) is kept between calls: allocating
    it per frame costs page faults worth a fifth or more of the resize inside the loader.
    """

    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self._sub_boxes: np.ndarray | None = None

    def __call__(self, image: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``image`` resized; written into ``out`` when it has the output's shape and dtype."""
        src_h, src_w = image.shape[:2]
        size = (self.width, self.height)
        k = max(math.ceil(src_w / self.width), math.ceil(src_h / self.height))
        if k == 1 or (src_w == k * self.width and src_h == k * self.height):
            return cv2.resize(image, size, dst=out, interpolation=cv2.INTER_AREA)  # already a fast path
        fx = k * self.width / src_w * _AREA_SCALE_SHRINK
        fy = k * self.height / src_h * _AREA_SCALE_SHRINK
        # cv2 reuses dst when its shape fits and allocates otherwise: keep whatever it returns.
        self._sub_boxes = cv2.resize(image, None, dst=self._sub_boxes, fx=fx, fy=fy, interpolation=cv2.INTER_AREA)
        return cv2.resize(self._sub_boxes, size, dst=out, interpolation=cv2.INTER_AREA)


def area_resize(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """One image resized by area (box-filter) resampling; see ``AreaResizer``."""
    return AreaResizer(width, height)(image)


class _ClipWriter:
    """Crops, area-resizes and optionally flips each decoded BGR or BGRA frame of one clip,
    and writes it as RGB (``channels=3``) or RGBA planes into ``frames[k]`` (``[T, C, H, W]``
    uint8): an RGBA clip of a frame without alpha is opaque, an RGB one drops the alpha.

    The box is computed on the first frame (decoded size, rotation applied) and reused,
    so all frames of a clip share it. The resize and flip buffers are allocated once per
    clip, not per frame. Writing the planes with ``cv2.split`` is ~30x faster than a
    ``permute().contiguous()`` copy.
    """

    def __init__(
        self, n_frames: int, height: int, width: int, area: float, u_y: float, u_x: float, flip: bool, channels: int = 3
    ):
        self.frames = np.empty((n_frames, channels, height, width), np.uint8)
        self.height, self.width = height, width
        self.area, self.u_y, self.u_x, self.flip = area, u_y, u_x, flip
        self.box: tuple[int, int, int, int] | None = None
        self._resize = AreaResizer(width, height)
        self._small = np.empty((height, width, 3), np.uint8)
        self._flipped = np.empty_like(self._small) if flip else None

    def __call__(self, frame: np.ndarray, k: int) -> np.ndarray:
        if self.box is None:
            self.box = crop_box(frame.shape[0], frame.shape[1], self.height, self.width, self.area, self.u_y, self.u_x)
        y, x, h, w = self.box
        small = self._resize(frame[y : y + h, x : x + w], out=self._small if frame.shape[2] == 3 else None)
        if self.flip:
            small = cv2.flip(small, 1, dst=self._flipped if small.shape[2] == 3 else None)
        out = self.frames[k]
        planes = [out[2], out[1], out[0]]
        if small.shape[2] == 4:  # B, G, R, A
            planes.append(out[3] if len(out) == 4 else np.empty_like(out[0]))
        elif len(out) == 4:
            out[3] = 255  # opaque
        cv2.split(small, planes)
        return out


# ----------------------------------------------------------------------------------------
# Dataset
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeReport:
    """Outcome of ``VideoClipDataset.validate``: unusable clips among those probed, by kind."""

    probed: int
    failed: int
    reasons: dict[str, int]

    @property
    def failure_fraction(self) -> float:
        return self.failed / max(self.probed, 1)

    def __str__(self) -> str:
        """In words, for the logs: "5 probed, all usable", "64 probed, 3 unusable (2 too short, 1 unreadable)"."""
        if not self.failed:
            return f"{self.probed} probed, all usable"
        return f"{self.probed} probed, {self.failed} unusable ({counts_in_words(self.reasons)})"


def counts_in_words(counts: dict[str, int]) -> str:
    """``{"too short": 2, "unreadable": 1}`` as "2 too short, 1 unreadable", most first."""
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items(), key=lambda item: -item[1]))


def shared_epoch() -> torch.Tensor:
    """An epoch counter in shared memory, so that ``set_epoch`` reaches persistent DataLoader workers."""
    return torch.zeros((), dtype=torch.int64).share_memory_()


class EpochDataset(Dataset):
    """A dataset whose random draws follow the epoch (``self._epoch``, made by ``shared_epoch``)."""

    _epoch: torch.Tensor

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's random draws; call before iterating each epoch."""
        self._epoch.fill_(epoch)


class VideoClipDataset(EpochDataset):
    """Map-style dataset of ``n_frames``-frame clips resized to exactly ``height x width``.

    Args:
        data_root: folder that annotation paths are relative to; scanned recursively for
            videos and images when there is no ``annotation_file``.
        annotation_file: users' JSON annotation, or a folder to scan.
        n_frames, height, width: output clip shape (T, C, H, W).
        channels: 3 (RGB: an image's alpha is dropped) or 4 (RGBA: images keep their alpha,
            videos are opaque).
        stride_range: inclusive (min, max) of the random temporal stride.
        crop_scale: (min, max) area fraction of the largest crop with the output aspect.
        hflip: random horizontal flips (train mode only).
        mode: "train" (random) or "val" (middle stride, centred start and crop, no flip,
            independent of the epoch).
        seed: base of every random draw; a sample depends only on (seed, epoch, index).
        short_clip_policy: "lower_stride" or "skip" (see ``fit_stride``).
        max_failure_fraction: ``validate`` raises above this fraction of bad clips.
        max_replacement_attempts: bad clips tried in a row before a sample raises.
        seek_threshold: jump in frames from which a seek is cheaper than reading on.
        decode_threads: FFmpeg threads per open video (1 suits many DataLoader workers).
        frame_cache_mb: train mode: keep each video's frames decoded in memory, downscaled
            to twice what the smallest crop needs, up to this many MB per loader process
            (0: off; videos beyond the budget are read from disk each time). Small crops
            from large videos then cost no seeking or decoding after a clip's first use;
            the crops come from the downscaled frames (a second area resize), so pixels
            differ slightly from uncached reads, identically in every run.
    """

    def __init__(
        self,
        data_root: str | Path | None = None,
        annotation_file: str | Path | None = None,
        *,
        n_frames: int = 12,
        height: int = 64,
        width: int = 64,
        stride_range: tuple[int, int] = (1, 5),
        crop_scale: tuple[float, float] = (0.5, 1.0),
        hflip: bool = True,
        mode: Literal["train", "val"] = "train",
        seed: int = 0,
        short_clip_policy: ShortClipPolicy = "lower_stride",
        max_failure_fraction: float = 0.05,
        max_replacement_attempts: int = 10,
        seek_threshold: int = 32,
        decode_threads: int = 1,
        channels: int = 3,
        frame_cache_mb: int = 0,
    ):
        if mode not in ("train", "val"):
            raise ValueError(f"mode must be 'train' or 'val', got {mode!r}")
        if short_clip_policy not in ("lower_stride", "skip"):
            raise ValueError(f"short_clip_policy must be 'lower_stride' or 'skip', got {short_clip_policy!r}")
        if not 1 <= stride_range[0] <= stride_range[1]:
            raise ValueError(f"stride_range must be (min, max) with 1 <= min <= max, got {stride_range}")
        if not 0 < crop_scale[0] <= crop_scale[1] <= 1:
            raise ValueError(f"crop_scale must be (min, max) with 0 < min <= max <= 1, got {crop_scale}")
        if min(n_frames, height, width) < 1:
            raise ValueError(f"n_frames, height and width must be positive, got {n_frames}, {height}, {width}")
        if channels not in (3, 4):
            raise ValueError(f"channels must be 3 (RGB) or 4 (RGBA), got {channels}")

        if annotation_file is not None and not Path(annotation_file).is_dir():
            self.clips = ClipTable.from_annotation(annotation_file, data_root)
            source = str(annotation_file)
        elif annotation_file is not None or data_root is not None:
            folder = annotation_file if annotation_file is not None else data_root
            self.clips = ClipTable.from_directory(folder, images=True)
            source = f"{folder} (scanned for {', '.join(clip_extensions(images=True))})"
        else:
            raise ValueError("give annotation_file (a JSON annotation or a folder) or data_root (a folder of videos)")
        self.source = source  # the annotation file or scanned folder, as messages name it
        self.refused_entries = list(self.clips.refused)
        if self.refused_entries:
            logger.warning(
                "%d annotation entries in %s are refused and left out, e.g. %s",
                len(self.refused_entries),
                source,
                self.refused_entries[0][1],
            )
        if len(self.clips) == 0:
            raise VideoDataError(
                f"no clips in {source}"
                + (
                    f" ({len(self.refused_entries)} entries refused, e.g. {self.refused_entries[0][1]})"
                    if self.refused_entries
                    else ""
                )
                + ": point data_root/annotation_file at your videos, write an "
                "annotation with `python -m training.make_annotations DIR -o annotations.json`, or "
                "generate demo data with `python -m training.demo_data OUT_DIR`"
            )

        self.n_frames, self.height, self.width, self.channels = n_frames, height, width, channels
        self.stride_range, self.crop_scale, self.hflip = stride_range, crop_scale, hflip
        self.mode, self.seed, self.short_clip_policy = mode, seed, short_clip_policy
        self.short_clips = self._leave_out_short_clips(source)
        self.max_failure_fraction = max_failure_fraction
        self.max_replacement_attempts = max_replacement_attempts
        self.seek_threshold, self.decode_threads = seek_threshold, decode_threads
        self.frame_cache_bytes = frame_cache_mb << 20 if mode == "train" else 0
        self._frame_cache: dict[int, DecodedVideo] = {}
        self._frame_cache_used = 0
        self._epoch = shared_epoch()
        self._reported: set[tuple[int, int]] = set()  # (clip, log level) already logged here

    @property
    def min_frames(self) -> int:
        """Decodable frames a clip needs to give a sample: ``n_frames`` (the stride is lowered
        to fit), or at the smallest stride under ``short_clip_policy="skip"``."""
        if self.short_clip_policy == "lower_stride":
            return self.n_frames
        return (self.n_frames - 1) * self.stride_range[0] + 1

    def _leave_out_short_clips(self, source: str) -> list[str]:
        """Leave out, up front, the clips whose annotated frame count is below ``min_frames``,
        and count them: a clip that can never give a sample would only be drawn, fail and be
        replaced. Returns their paths. Clips of unknown length are checked when loaded."""
        need = self.min_frames
        short = (self.clips.frames >= 0) & (self.clips.frames < need)
        if not short.any():
            return []
        advice = (
            f"`python -m training.make_annotations DIR -o annotations.json --min_frames {need}` writes an "
            "annotation without them"
        )
        if short.all():
            raise VideoDataError(
                f"all {len(short)} clips in {source} have fewer than the {need} frames a sample needs "
                f"(n_frames={self.n_frames}): lower n_frames or use longer clips; {advice}"
            )
        logger.warning(
            "%d of %d clips in %s have fewer than the %d frames a sample needs (n_frames=%d) and are left out; %s",
            short.sum(),
            len(short),
            source,
            need,
            self.n_frames,
            advice,
        )
        left_out = [self.clips.path(i) for i in np.flatnonzero(short)]
        self.clips = self.clips.subset(np.flatnonzero(~short))
        return left_out

    def __len__(self) -> int:
        return len(self.clips)

    def _rng(self, index: int) -> np.random.Generator:
        epoch = 0 if self.mode == "val" else self.epoch
        return np.random.default_rng([self.seed, epoch, index])

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} clips")
        rng = self._rng(index)
        clip = index
        for failures in range(self.max_replacement_attempts + 1):
            try:
                frames = self._load(clip, rng)
            except BadClipError as err:
                self._log_once(clip, logging.WARNING, f"skipped: {err}")
                # Deterministic replacement: another index from the sample's own generator.
                clip = (clip + 1 + int(rng.integers(max(len(self) - 1, 1)))) % len(self)
                continue
            return {"frames": frames, "index": clip, "failures": failures}
        raise VideoDataError(
            f"sample {index}: {self.max_replacement_attempts + 1} clips in a row were unusable, see the warnings "
            "above. If files were removed or a storage mount went away, restore them; otherwise clean the "
            "annotation with `python -m training.make_annotations` or raise max_replacement_attempts"
        )

    def load_clip(self, index: int) -> torch.Tensor:
        """Clip ``index`` exactly as ``__getitem__`` draws it, without replacement: raises
        BadClipError when it cannot give a sample (evaluation skips and reports it rather
        than averaging another clip in)."""
        return self._load(int(index), self._rng(int(index)))

    def _log_once(self, clip: int, level: int, message: str) -> None:
        key = (clip, level)
        if key not in self._reported:
            self._reported.add(key)
            logger.log(level, "clip %d (%s) %s", clip, self.clips.path(clip), message)

    def _draw_window(self, length: int, rng: np.random.Generator) -> tuple[int, int]:
        lo, hi = self.stride_range
        stride = (lo + hi) // 2 if self.mode == "val" else int(rng.integers(lo, hi + 1))
        fitted = fit_stride(length, self.n_frames, stride, self.short_clip_policy)
        if fitted is None:
            raise BadClipError(
                "too short",
                f"{length} frames for {self.n_frames} frames at stride {stride} "
                f"(short_clip_policy={self.short_clip_policy!r})",
            )
        last_start = length - ((self.n_frames - 1) * fitted + 1)
        start = last_start // 2 if self.mode == "val" else int(rng.integers(last_start + 1))
        return start, fitted

    def _load(self, clip: int, rng: np.random.Generator) -> torch.Tensor:
        path = self.clips.path(clip)
        if self.mode == "val":
            writer = _ClipWriter(
                self.n_frames, self.height, self.width, self.crop_scale[1], 0.5, 0.5, False, self.channels
            )
        else:
            area = float(rng.uniform(*self.crop_scale))
            u_y, u_x = (float(u) for u in rng.random(2))
            flip = self.hflip and bool(rng.random() < 0.5)
            writer = _ClipWriter(self.n_frames, self.height, self.width, area, u_y, u_x, flip, self.channels)
        with self._open(clip, path) as reader:
            length = int(self.clips.frames[clip])
            if length < 0:
                length = reader.container_frame_count
            if length < 0:  # the container does not say: count what decodes
                length = reader.count_frames()
                self._log_once(clip, logging.INFO, f"states no frame count; {length} frames decode")
            if length == 0:
                raise BadClipError("no decodable frames")
            start, stride = self._draw_window(length, rng)
            _, decoded = reader.read(start, stride, self.n_frames, writer)
            if decoded is not None:
                # Container (and some annotation) counts can exceed what decodes: draw
                # again within the frames that really decode.
                if decoded == 0:
                    raise BadClipError("no decodable frames")
                self._log_once(clip, logging.INFO, f"decodes {decoded} frames, not {length}; sampling within them")
                start, stride = self._draw_window(decoded, rng)
                _, again = reader.read(start, stride, self.n_frames, writer)
                if again is not None:
                    raise BadClipError("truncated", f"decoding stopped at frame {again}, then at {decoded} before")
        return torch.from_numpy(writer.frames)

    def _open(self, clip: int, path: str) -> VideoReader | ImageReader | DecodedVideo:
        """The reader for clip ``clip``: its cached frames, decoded now if the cache has room,
        else the file."""
        if not self.frame_cache_bytes or Path(path).suffix.lower() in IMAGE_EXTENSIONS:
            return open_clip(path, seek_threshold=self.seek_threshold, threads=self.decode_threads)
        if clip in self._frame_cache:
            return self._frame_cache[clip]
        if self._frame_cache_used >= self.frame_cache_bytes:
            return open_clip(path, seek_threshold=self.seek_threshold, threads=self.decode_threads)
        video = DecodedVideo.decode(path, self._cache_scale, self.decode_threads)
        if self._frame_cache_used + video.frames.nbytes <= self.frame_cache_bytes:
            self._frame_cache[clip] = video
            self._frame_cache_used += video.frames.nbytes
        return video

    def _cache_scale(self, height: int, width: int) -> float:
        """The downscale factor of a cached video: its smallest crop keeps twice the output size."""
        _, _, h, w = crop_box(height, width, self.height, self.width, self.crop_scale[0])
        return max(2 * self.height / h, 2 * self.width / w)

    def probe(self, sample_size: int = 64) -> ProbeReport:
        """Load up to ``sample_size`` clips (seeded choice) without replacement and raise
        VideoDataError if more than ``max_failure_fraction`` of them are unusable.

        Call once at start-up so that a wrong data path or a broken dataset stops the run
        before training instead of being papered over by replacements.
        """
        n = min(sample_size, len(self))
        picks = np.sort(np.random.default_rng([self.seed, 1]).choice(len(self), size=n, replace=False))
        reasons: dict[str, int] = {}
        examples: list[str] = []
        for clip in picks.tolist():
            try:
                self._load(clip, self._rng(clip))
            except BadClipError as err:
                self._log_once(clip, logging.WARNING, f"skipped: {err}")
                reasons[err.kind] = reasons.get(err.kind, 0) + 1
                examples.append(self.clips.path(clip))
        report = ProbeReport(probed=n, failed=len(examples), reasons=reasons)
        logger.info("probed clips: %s", report)
        if report.failure_fraction > self.max_failure_fraction:
            min_frames = f" --min_frames {self.n_frames}" if "too short" in reasons else ""
            raise VideoDataError(
                f"{report.failed} of {n} probed clips are unusable ({report.failure_fraction:.0%} > "
                f"max_failure_fraction={self.max_failure_fraction:.0%}) in {self.source}; reasons: {reasons}; e.g. "
                f"{examples[:3]}. Check it and data_root, regenerate the annotation with "
                f"`python -m training.make_annotations DIR -o annotations.json{min_frames}` (it drops unusable "
                "files"
                + (" and clips shorter than n_frames" if min_frames else "")
                + "), or raise max_failure_fraction."
            )
        return report


# ----------------------------------------------------------------------------------------
# DataLoader
# ----------------------------------------------------------------------------------------


class EpochShuffleSampler(Sampler[int]):
    """A permutation that depends only on (seed, dataset.epoch).

    Unlike a RandomSampler whose generator advances with each epoch, a resumed run gets
    the same order for the same epoch, and every rank computes the same permutation
    (Accelerate then gives each rank its share). ``set_epoch`` (called by Accelerate's
    DataLoader wrapper) forwards to the dataset, so the epoch has a single source.
    """

    def __init__(self, dataset: VideoClipDataset, seed: int):
        self.dataset = dataset
        self.seed = seed

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.dataset.epoch)
        return iter(torch.randperm(len(self.dataset), generator=generator).tolist())


def leave_stop_signals_to_parent(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: a preempted job's SIGTERM, or Ctrl+C, reaches every
    process of the job, workers included; a worker that died of it would crash the
    training process before it can save. So workers ignore SIGINT, and SIGTERM unless it
    comes from their parent (how the DataLoader shuts down a worker that does not stop by
    itself): it is blocked and taken by a thread that checks the sender."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(
        target=_exit_on_sigterm_from, args=(os.getppid(),), daemon=True, name="sigterm-from-parent"
    ).start()


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Hold SIGTERM and SIGINT in this thread while DataLoader workers start: a worker
    inherits the mask when it is forked, so a stop signal sent to the whole job before its
    ``worker_init_fn`` runs stays pending (and is then ignored there) instead of killing
    it; this process takes its own signal once the workers are up."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _exit_on_sigterm_from(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)


def build_dataloader(
    dataset: VideoClipDataset,
    batch_size: int,
    num_workers: int = 4,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    prefetch_factor: int = 2,
    persistent_workers: bool = True,
    pin_memory: bool = False,
) -> DataLoader:
    """DataLoader over a VideoClipDataset; batches are ``{"frames": [N, T, C, H, W], ...}`` (C = 3, or 4 for RGBA).

    Pass it to ``accelerator.prepare`` for rank sharding, and call
    ``dataset.set_epoch(epoch)`` (or the prepared loader's ``set_epoch``) each epoch.
    """
    # Do not call cv2.setNumThreads in a worker_init_fn: in a forked worker it can block
    # forever on the parent's OpenCV thread-pool state. Decoding is already 1 thread/clip.
    # Workers leave SIGTERM/SIGINT to the training process, which stops them itself.
    workers_kwargs = {}
    if num_workers > 0:
        workers_kwargs = dict(prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=EpochShuffleSampler(dataset, seed) if shuffle else None,
        num_workers=num_workers,
        worker_init_fn=leave_stop_signals_to_parent if num_workers > 0 else None,
        drop_last=drop_last,
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(seed),
        **workers_kwargs,
    )
