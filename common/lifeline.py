"""Processes that end when the process they work for is gone.

Torch elastic starts each training process in a session of its own, so neither a signal
to the job's process group (``kill -9 -- -PGID``) nor the death of the launcher reaches
them: they would train on as orphans, holding the run lock and the GPUs. Loader and probe
workers would likewise outlive a parent killed by SIGKILL, and a worker forked after the
run lock was taken holds the lock with it (a forked process shares the lock's open file).
Each such process ties itself to its parent here, and ends with SIGKILL, as if the
``kill -9`` had reached it too: nothing is saved after the last checkpoint, which is intact.

- ``end_with_parent``: on Linux the kernel's parent-death signal (``PR_SET_PDEATHSIG``),
  which needs no thread of this process to run (a process stuck in C code ends too), then
  a check that the parent did not die before it was set. The kernel sends it when the
  *thread* that forked the process ends, so it suits processes forked by their parent's
  main thread (torch elastic's agent, the probe pool); elsewhere it falls back to
  ``watch_parent``.
- ``watch_parent``: a thread that looks every ``WATCH_INTERVAL_S`` seconds whether the
  parent is still there; for DataLoader workers, which the prefetching thread forks and
  which must outlive it (a parent-death signal would kill them when it ends, and the
  loader would report them as crashed).
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
import time

# set by ``training.launch`` for the processes it starts: whose death ends them, including
# a death before their first line ran (their parent then is another process already)
LAUNCHER_PID = "TAEHV_LAUNCHER_PID"
WATCH_INTERVAL_S = 0.5
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_launcher() -> None:
    """In a training process started by torch elastic (``accelerate launch``, ``training.launch``):
    end with the launcher, named by ``LAUNCHER_PID`` or else this process's parent now. A
    process started otherwise (one process from a shell) is in its launcher's process group
    and session, which a signal to the job reaches: nothing to do."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    end_with_parent(int(os.environ.get(LAUNCHER_PID, os.getppid())))


def end_with_parent(parent: int) -> None:
    """End this process (SIGKILL) once ``parent``, the process that started it, is gone; at
    once when it is gone already."""
    if not sys.platform.startswith("linux"):
        watch_parent(parent)
        return
    # prctl(2), PR_SET_PDEATHSIG: the "parent" is the thread that forked this process, and no
    # signal comes for a parent already gone when it is set (hence the getppid check after it)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl(PR_SET_PDEATHSIG): {os.strerror(ctypes.get_errno())}")
    if os.getppid() != parent:  # it died before the signal was set: this process has another parent already
        _end()


def watch_parent(parent: int) -> None:
    """A daemon thread that ends this process (SIGKILL) within ``WATCH_INTERVAL_S`` seconds
    of ``parent``'s death (it then has another parent). A thread of this process that fails
    because the parent died first (a connection to it reset: multiprocessing's resource
    sharer in a loader worker) ends the process the same way, without a traceback; a thread
    that fails while the parent lives is reported as Python reports it. Both hooks are
    wrapped: a thread's uncaught failure reaches ``threading.excepthook``, while the resource
    sharer catches its own and reports them through ``sys.excepthook``."""
    threading.excepthook = functools.partial(_end_if_orphaned, parent, threading.excepthook)
    sys.excepthook = functools.partial(_end_if_orphaned, parent, sys.excepthook)
    threading.Thread(target=_watch, args=(parent,), daemon=True, name="parent-watch").start()


def _end_if_orphaned(parent: int, report, *failure) -> None:
    """``threading.excepthook`` and ``sys.excepthook``: the kernel closes a dying parent's
    connections before it gives its children another parent, so the failure may come first:
    wait up to two watch intervals for the parent's death before reporting it."""
    deadline = time.monotonic() + 2 * WATCH_INTERVAL_S
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.01)
    if os.getppid() != parent:
        _end()
    report(*failure)


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)
    _end()


def _end() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
