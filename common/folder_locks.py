"""Checkpoint folders held by the tools that read them, so that a run still training cannot
delete them underneath.

``inference.py`` and the export read a run that may still be training: its rotation
(``checkpoints_total_limit``) deletes old checkpoints, and ``best_model/`` is replaced at
each new best. A reader holds a shared ``flock`` on the folder's manifest
(``checkpoint.json``) from the moment it chooses the folder until it has loaded the
weights (``hold_for_reading``); the rotation passes over a folder a reader holds (it goes
at a later rotation, ``remove_unless_read``), and replacing ``best_model/`` waits for its
readers, which hold it for the seconds of a load (``replacing``). A lock, rather than
retrying on another checkpoint after a failed read, because the newest checkpoint may be
the one rotated away, and a retry can fail again; rather than copying, because a copy of
every checkpoint read costs its size in time and disk. A reader whose folder was removed or
replaced before it got its lock sees that the manifest is no longer the file it locked, and
chooses again. The kernel drops a lock when its process ends (``kill -9`` included), so a
lock is never stale. On a file system without locks (some network mounts) a warning says
that reads are not protected.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

CHECKPOINT_MANIFEST = "checkpoint.json"
logger = logging.getLogger(__name__)


def _lock(handle: IO[bytes], operation: int) -> bool:
    """``flock`` ``handle``; False (with a warning) on a file system without locks.
    BlockingIOError for a non-blocking lock that is held elsewhere."""
    try:
        fcntl.flock(handle, operation)
    except BlockingIOError:
        raise
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        logger.warning("the file system of %s has no locks (%s): a run's rotation may remove it", handle.name, err)
        return False
    return True


def hold_for_reading(folder: Path) -> IO[bytes] | None:
    """The manifest of ``folder``, open and locked shared: rotation keeps the folder until it
    is closed. None when the folder is gone, or was replaced before the lock was granted
    (choose again)."""
    manifest = folder / CHECKPOINT_MANIFEST
    try:
        handle = open(manifest, "rb")
    except FileNotFoundError:
        return None
    _lock(handle, fcntl.LOCK_SH)  # waits only while a removal or replacement is under way
    try:
        now = os.stat(manifest)
    except FileNotFoundError:
        now = None
    held = os.fstat(handle.fileno())
    if now is None or (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
        handle.close()
        return None
    return handle


def remove_unless_read(folder: Path) -> bool:
    """Remove ``folder`` unless a reader holds it (``hold_for_reading``); True when removed."""
    with open(folder / CHECKPOINT_MANIFEST, "r+b") as handle:
        try:
            _lock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        shutil.rmtree(folder)
    return True


@contextmanager
def replacing(folder: Path) -> Iterator[None]:
    """Hold ``folder`` exclusively while the block removes or replaces it: waits for the
    readers that hold it; nothing to wait for without a manifest."""
    manifest = folder / CHECKPOINT_MANIFEST
    if not manifest.is_file():
        yield
        return
    with open(manifest, "r+b") as handle:
        _lock(handle, fcntl.LOCK_EX)
        yield
