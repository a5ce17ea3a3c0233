"""Processes tied to their parent (``common.lifeline``) end when it is killed with SIGKILL,
through the kernel's parent-death signal or the watching thread, and at once when the
parent was gone before the tie was made."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from taehv_train.common.lifeline import LAUNCHER_PID
from train_runs import all_ended, processes_of, wait_for

# the parent starts the child, which ties itself to it and says so, then both wait for good
PARENT = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', sys.argv[1], *sys.argv[2:]])\n"
    "time.sleep(600)\n"
)
CHILD = (
    "import os, sys, time\n"
    "from taehv_train.common import lifeline\n"
    "getattr(lifeline, sys.argv[1])(os.getppid())\n"
    "print('tied', flush=True)\n"
    "time.sleep(600)\n"
)


def kill_the_parent(marker, parent_code: str, *child_args: str) -> str:
    """Start ``parent_code``, which starts a child with ``child_args`` and ``marker`` (named on
    both command lines, to find them); once the child says it is tied, kill -9 the parent
    alone (the child is in its process group but not signalled) and wait for the child to
    end. Returns the job's stderr."""
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code, *child_args, str(marker)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        start_new_session=True,
    )
    try:
        assert parent.stdout.readline() == "tied\n"
        [child] = [pid for pid in processes_of(marker) if pid != parent.pid]
        parent.kill()
        parent.wait()
        wait_for(lambda: all_ended([child]), timeout=30, what=f"child {child} to end with its parent")
        return parent.stderr.read()
    finally:
        with contextlib.suppress(ProcessLookupError):  # none left when the child ended
            os.killpg(parent.pid, signal.SIGKILL)  # what is left of this test's processes, if it failed


@pytest.mark.parametrize("tie", ["end_with_parent", "watch_parent"])
def test_a_child_ends_with_its_parent_killed_by_sigkill(tmp_path, tie):
    kill_the_parent(tmp_path / "job", PARENT, CHILD, tie)


# the parent holds a pipe's writing end; the child watches it, and two of its threads fail
# when the pipe closes (the parent's death), one uncaught, one caught and reported through
# sys.excepthook as multiprocessing's resource sharer reports its failures; another fails
# while the parent lives
PARENT_WITH_PIPE = (
    "import os, subprocess, sys, time\n"
    "read, write = os.pipe()\n"
    "subprocess.Popen([sys.executable, '-c', sys.argv[1], str(read), *sys.argv[2:]], pass_fds=[read])\n"
    "time.sleep(600)\n"
)
CHILD_WITH_THREADS = (
    "import os, sys, threading, time\n"
    "from taehv_train.common import lifeline\n"
    "lifeline.watch_parent(os.getppid())\n"
    "def alive():\n"
    "    raise ValueError('failed while the parent lives')\n"
    "def orphaned():\n"
    "    os.read(int(sys.argv[1]), 1)  # the end of the pipe: the parent is dying\n"
    "    raise ConnectionResetError(104, 'Connection reset by peer')\n"
    "def orphaned_reported():\n"
    "    try:\n"
    "        orphaned()\n"
    "    except Exception:\n"
    "        sys.excepthook(*sys.exc_info())\n"
    "threading.Thread(target=alive).start()\n"
    "threading.Thread(target=orphaned).start()\n"
    "threading.Thread(target=orphaned_reported).start()\n"
    "time.sleep(1.5)\n"
    "print('tied', flush=True)\n"
    "time.sleep(600)\n"
)


def test_a_thread_that_fails_because_the_parent_died_ends_the_process_without_a_traceback(tmp_path):
    """A loader worker's connection to its training process resets when that process is
    killed, before the worker has another parent: the worker ends as its watch would end
    it, with no traceback on the job's stderr; a failure while the parent lives is reported."""
    stderr = kill_the_parent(tmp_path / "job", PARENT_WITH_PIPE, CHILD_WITH_THREADS)
    assert "ValueError: failed while the parent lives" in stderr
    assert "ConnectionResetError" not in stderr, stderr


@pytest.mark.parametrize("elastic", [True, False], ids=["torch-elastic", "from-a-shell"])
def test_a_launcher_gone_before_the_first_line_ends_a_training_process_started_by_torch_elastic(elastic):
    """The parent-death signal is set once the training process runs: a launcher that died
    before is noticed by the pid ``training.launch`` names (the process has another parent by
    then), and the process ends at once. A process torch elastic did not start (one process
    from a shell, in its job's process group) is left alone."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    environment = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    if elastic:
        environment["TORCHELASTIC_RUN_ID"] = "none"
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "from taehv_train.common.lifeline import end_with_launcher\nend_with_launcher()\nprint('on')",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
        env={**environment, LAUNCHER_PID: str(gone.pid)},
    )
    assert (child.returncode, child.stdout) == ((-signal.SIGKILL, "") if elastic else (0, "on\n"))
