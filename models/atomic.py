"""Writing files so that a crash never leaves a half-written one under the final name.

Every file the project writes for later reading (weights, checkpoint manifests, latent
cache shards) goes through ``atomic_write``: the content goes to ``.tmp-<name>`` next to
the target, is flushed to disk, and is renamed into place, which POSIX makes atomic.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

TMP_PREFIX = ".tmp-"


def temporary_name(path: Path) -> Path:
    """Where ``path`` (a file or a folder) is written before it is renamed into place."""
    return path.with_name(TMP_PREFIX + path.name)


def fsync_directory(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, content: bytes | str | Callable[[Path], None]) -> Path:
    """Write ``content`` (bytes, text, or a function that writes the file it is given) to
    ``path`` atomically; the folder is created when missing. Files get the usual umask
    permissions (a cache or a run folder is often shared). A write that fails removes its
    temporary file and raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        if callable(content):
            content(tmp)
        else:
            with open(tmp, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, say: the partial file would keep the space the user is asked to free
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
    return path
