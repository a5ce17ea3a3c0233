"""One training process writes a run directory at a time.

Two runs started with the same ``output_dir`` and ``run_name`` (or resuming the same run)
would interleave their checkpoints and logs. The main process holds an exclusive
``flock`` on ``<run_dir>/.train.lock`` for its whole life; the kernel releases it when the
process ends, however it ends (kill -9 included), so a lock is never left stale. A file
system without locks (some network mounts) is warned about, not refused.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from pathlib import Path
from typing import IO

from taehv_train.base.errors import UserError

LOCK_NAME = ".train.lock"
logger = logging.getLogger(__name__)


def lock_run_dir(run_dir: Path) -> IO[str]:
    """Hold ``run_dir``'s lock (keep the returned file open for the run's life); a
    UserError naming the holder when another process holds it."""
    handle = open(run_dir / LOCK_NAME, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise UserError(
            f"{run_dir} is being written by another training run ({holder}): wait for it to end or stop "
            "it, or give this run another --run_name or --output_dir"
        ) from None
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        logger.warning(
            "the file system of %s has no locks (%s): two runs started into it at once are not refused",
            run_dir,
            err.strerror,
        )
        return handle
    handle.truncate(0)
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    return handle


def release_run_dir(handle: IO[str]) -> None:
    """Let the run directory go: the holder's line is cleared, then the lock dropped."""
    handle.truncate(0)
    handle.close()
