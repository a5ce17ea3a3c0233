"""A process of training (or of the latent cache, the launcher, export, make_annotations)
ends as every process ends (threads joined, exit handlers run, output flushed, its exit
status kept) but without the interpreter's teardown, which costs about a second and in
which gloo's worker threads can abort a process that ended cleanly (``base.process_exit``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO_ROOT

# each file the process writes says that a step of its exit ran: an exit handler, a thread
# that is not a daemon finishing late, and the teardown (a module-level object's __del__)
PROCESS = """
import atexit, concurrent.futures, sys, threading, time
from pathlib import Path
from taehv_train.base.process_exit import exit_without_teardown
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

if sys.argv[3] == "wrapped":
    with exit_without_teardown():
        main()
else:
    main()
"""


@pytest.mark.parametrize("wrapped", [True, False], ids=["exit_without_teardown", "python"])
@pytest.mark.parametrize("ending", ["0", "3", "a message"])
def test_a_process_exits_as_python_exits_without_the_teardown(tmp_path, wrapped, ending):
    """Without the wrapper the same process ends as Python ends it, teardown included."""
    result = subprocess.run(
        [sys.executable, "-c", PROCESS, str(tmp_path), ending, "wrapped" if wrapped else "python"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
    )
    assert result.returncode == (int(ending) if ending.isdigit() else 1), result.stderr
    assert result.stdout == "unflushed output"
    assert result.stderr == ("" if ending.isdigit() else "a message\n")
    ran = {path.name for path in tmp_path.iterdir()}
    assert ran == ({"exit_handler", "thread"} if wrapped else {"exit_handler", "thread", "teardown"})
