"""Which files are clips, and why one cannot give a sample: finding videos and images in a
folder, refusing FIFOs, sockets and devices before anything opens them, and turning what
OpenCV or PyAV report into a ``BadClipError`` with a short kind."""

from __future__ import annotations

import io
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import cv2

VIDEO_EXTENSIONS = (".mp4", ".avi", ".mov", ".mkv", ".webm")
IMAGE_EXTENSIONS = (".png", ".webp")  # images, read with their alpha channel: one frame, or an animation's frames


class BadClipError(Exception):
    """One clip cannot produce a sample; the dataset counts it and uses another clip.

    ``kind`` is a short category ("missing", "unreadable", ...) used to summarise reports.
    """

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


@dataclass(frozen=True)
class ClipBytes:
    """A clip file's bytes held in memory (a member of a tar shard), read by the same
    decoders as a file on disk: OpenCV and PyAV both read a file object, so a clip from a
    shard decodes to the same pixels as the file it was packed from."""

    name: str  # "<shard URL>#<member>", for messages; its suffix is the member's
    data: bytes

    def __str__(self) -> str:
        return self.name


Clip = str | ClipBytes  # a clip file's path, or its bytes


def clip_name(clip: Clip) -> str:
    """The name messages give ``clip``, whose suffix says its format."""
    return str(clip)


def openable(clip: Clip) -> str | io.BytesIO:
    """What a decoder opens: the path, or a fresh file object over the bytes."""
    return io.BytesIO(clip.data) if isinstance(clip, ClipBytes) else clip


def check_openable(clip: Clip) -> None:
    """``check_regular_file`` for a path (bytes in memory are always safe to open)."""
    if not isinstance(clip, ClipBytes):
        check_regular_file(clip)


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


def why_not_a_video(path: Clip) -> BadClipError:
    """Why OpenCV cannot open ``path`` as a video, from the streams PyAV finds in it: none is
    a video stream (an audio-only MP4), or the file is no container FFmpeg reads, or its
    video stream does not decode."""
    import av  # only for files OpenCV cannot open

    try:
        with av.open(openable(path)) as container:
            kinds = sorted({stream.type for stream in container.streams})
    except av.FFmpegError:
        return BadClipError("unreadable", "not a video, unsupported codec or truncated container")
    if "video" not in kinds:
        return BadClipError(
            "no video stream", f"it has only {' and '.join(kinds)} streams" if kinds else "it has no streams"
        )
    return BadClipError("unreadable", "its video stream does not decode (unsupported codec or damaged)")
