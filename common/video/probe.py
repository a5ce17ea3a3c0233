"""Opening any clip file (video or image) and measuring it: true length, frame rate, size."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from taehv_train.common.video.files import IMAGE_EXTENSIONS, BadClipError, Clip, ClipBytes, clip_name
from taehv_train.common.video.in_memory import ImageReader
from taehv_train.common.video.packet_count import count_frames_from_packets
from taehv_train.common.video.reader import VideoReader


def open_clip(path: Clip, **options: object) -> VideoReader | ImageReader:
    """The reader for ``path`` (or a shard member's bytes): images by their extension,
    anything else as a video."""
    return (ImageReader if Path(clip_name(path)).suffix.lower() in IMAGE_EXTENSIONS else VideoReader)(path, **options)


@dataclass(frozen=True)
class VideoInfo:
    frames: int  # frames that actually decode
    fps: float
    width: int
    height: int


def probe_video(path: str | Path | ClipBytes, threads: int = 1, exact_decode: bool = False) -> VideoInfo:
    """A video's (or image file's) true length, frame rate and size; raises BadClipError if
    unusable, without opening a FIFO, socket or device.

    The size and frame rate are OpenCV's; the length is the number of frames OpenCV's
    ``grab`` yields from frame 0 to the end. Of an H.264 or HEVC video it is counted from
    the packets when they prove it (``count_frames_from_packets``), which reads the file
    but decodes nothing; otherwise, or with ``exact_decode``, every frame is decoded.
    """
    clip = path if isinstance(path, ClipBytes) else str(path)
    with open_clip(clip, threads=threads) as reader:
        fps, (width, height) = reader.fps, reader.size
        frames = None
        if isinstance(reader, VideoReader) and not exact_decode:
            frames = count_frames_from_packets(clip, reader.container_frame_count).frames
        if frames is None:
            frames = reader.count_frames()
    if frames == 0:
        raise BadClipError("no decodable frames")
    return VideoInfo(frames=frames, fps=fps, width=width, height=height)
