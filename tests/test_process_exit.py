"""A process of a multi-process run ends as every process ends (threads joined, exit
handlers run, output flushed, its exit status kept) but without the interpreter's teardown,
in which gloo's worker threads can abort a process that ended cleanly
(``training.loop.distributed.exit_without_teardown``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

# each file the process writes says that a step of its exit ran: an exit handler, a thread
# that is not a daemon finishing late, and the teardown (a module-level object's __del__)
PROCESS = """
import atexit, concurrent.futures, sys, threading, time
from pathlib import Path
from taehv_train.training.loop.distributed import exit_without_teardown
folder = Path(sys.argv[1])

class TornDown:
    def __del__(self):
        (folder / "teardown").write_text("ran")

torn_down = TornDown()
atexit.register(lambda: (folder / "exit_handler").write_text("ran"))

def late():
    time.sleep(0.3)
    (folder / "thread").write_text("ran")

def main():
    threading.Thread(target=late).start()
    concurrent.futures.ThreadPoolExecutor(1).submit(int)  # an idle worker, ended at exit
    sys.stdout.write("unflushed output")
    sys.exit(int(sys.argv[2]) if sys.argv[2].isdigit() else sys.argv[2])

with exit_without_teardown():
    main()
"""


@pytest.mark.parametrize("world_size, ending", [(2, "3"), (2, "a message"), (1, "0")])
def test_a_process_of_a_multi_process_run_exits_without_the_interpreters_teardown(tmp_path, world_size, ending):
    """One process (WORLD_SIZE=1) keeps Python's own exit, teardown included."""
    result = subprocess.run(
        [sys.executable, "-c", PROCESS, str(tmp_path), ending],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
        env={**os.environ, "WORLD_SIZE": str(world_size)},
    )
    assert result.returncode == (int(ending) if ending.isdigit() else 1), result.stderr
    assert result.stdout == "unflushed output"
    assert result.stderr == ("" if ending.isdigit() else "a message\n")
    ran = {path.name for path in tmp_path.iterdir()}
    assert ran == ({"exit_handler", "thread"} if world_size > 1 else {"exit_handler", "thread", "teardown"})
