"""Writing files so that a crash or a full disk never leaves a half-written one under the final name.

Every file the project writes for later reading (weights, checkpoint manifests, latent
cache shards, annotation files, run records, evaluation reports) goes through
``atomic_write``: the content goes to ``.tmp-<name>`` next to the target, is flushed to
disk, and is renamed into place, which POSIX makes atomic. ``atomic_write_all`` does the
same for files that belong together (a train/val split): none is replaced unless all
were written.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

TMP_PREFIX = ".tmp-"

Content = bytes | str | Callable[[Path], None]


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


def _write_synced(tmp: Path, content: Content) -> None:
    if callable(content):
        content(tmp)
    else:
        with open(tmp, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())


def atomic_write_all(files: Mapping[str | os.PathLike, Content]) -> list[Path]:
    """Write each file of ``files`` (path -> bytes, text, or a function that writes the file
    it is given) atomically, and replace none of them unless all were written: a failure
    leaves every earlier file as it was. Folders are created when missing; files get the
    usual umask permissions (a cache or a run folder is often shared). A write that fails
    removes the temporary files and raises."""
    targets = {Path(path): content for path, content in files.items()}
    written: list[Path] = []
    try:
        for path, content in targets.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            written.append(temporary_name(path))
            _write_synced(written[-1], content)
        for path in targets:
            os.replace(temporary_name(path), path)
    except BaseException:  # a full disk, say: the partial files would keep the space the user is asked to free
        for tmp in written:
            tmp.unlink(missing_ok=True)
        raise
    for folder in {path.parent for path in targets}:
        fsync_directory(folder)
    return list(targets)


def atomic_write(path: str | os.PathLike, content: Content) -> Path:
    """Write ``content`` (bytes, text, or a function that writes the file it is given) to
    ``path`` atomically (``atomic_write_all`` of one file)."""
    return atomic_write_all({path: content})[0]
