"""PyAV's decoding of a video, for the files OpenCV's FFmpeg opens but decodes no frame of:
AV1 in the opencv-python wheels, whose FFmpeg has only the hardware AV1 decoder, while
PyAV's wheels carry libdav1d. Imported only when such a file turns up (``VideoReader``)."""

from __future__ import annotations

import io
import logging

import av
import numpy as np

logger = logging.getLogger(__name__)


class PyAVOpenError(Exception):
    """PyAV cannot open the file either, or finds no video stream in it."""


class PyAVStream:
    """A video's best video stream decoded by PyAV and read forward, behind the calls of
    ``cv2.VideoCapture`` that ``VideoReader`` reads on with: ``grab`` (decode), ``read``
    (decode and convert to BGR) and ``release``. It does not seek. A decoding error ends
    the stream, as it ends OpenCV's ``grab``: the frames before it are what decodes."""

    def __init__(self, path: str | io.BytesIO, threads: int = 1):
        """Raises PyAVOpenError when PyAV cannot open ``path`` (a file name or a file object)
        or finds no video stream in it."""
        self.path = path
        try:
            self._container = av.open(path)
        except av.FFmpegError as err:
            raise PyAVOpenError(f"PyAV cannot open it either ({err})") from err
        stream = self._container.streams.best("video")
        if stream is None:
            self._container.close()
            raise PyAVOpenError("PyAV finds no video stream in it")
        stream.codec_context.thread_count = threads
        self._frames = self._container.decode(stream)

    def _next(self) -> av.VideoFrame | None:
        try:
            return next(self._frames, None)
        except av.FFmpegError as err:  # the stream ends here, as OpenCV's grab() returns False
            logger.debug("decoding %s stopped: %s", self.path, err)
            return None

    def grab(self) -> bool:
        return self._next() is not None

    def read(self) -> tuple[bool, np.ndarray | None]:
        frame = self._next()
        return (False, None) if frame is None else (True, frame.to_ndarray(format="bgr24"))

    def release(self) -> None:
        self._container.close()
