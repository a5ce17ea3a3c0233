"""How training, the latent cache, the launcher, export and make_annotations exit: as every
Python process exits, then at once.

At exit the interpreter first joins the threads that are not daemons and runs the exit
handlers (logging's, multiprocessing's, temporary files'); then it tears itself down, object
by object. That teardown costs a process of this package about a second of CPU (the
modules of torch, diffusers and transformers freed one by one, which the kernel frees at
once when the process ends), and in a multi-process run it can abort a process that ended
cleanly: the process groups outlive ``destroy_process_group`` while anything holds them
(DeepSpeed's engine does, through the hooks it leaves on the parameters), so gloo's worker
threads still run during the teardown, and one that drops a tensor then needs the GIL of an
interpreter going away ("terminate called without an active exception",
pytorch/pytorch#190489); the launcher would report a dead rank. ``exit_without_teardown``
does the first part as ``Py_FinalizeEx`` (CPython's Python/pylifecycle.c) does it and skips
the second.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def exit_without_teardown() -> Iterator[None]:
    """Around a process's entry point: when it returns or exits (``sys.exit``), threads that
    are not daemons are joined, the exit handlers run, stdout and stderr are flushed, and the
    process ends with its exit status without the interpreter's teardown. Anything else the
    entry point raises (a crash) ends the process as Python ends it, with its traceback."""
    status = 0
    try:
        yield
    except SystemExit as ended:
        if ended.code is not None and not isinstance(ended.code, int):
            print(ended.code, file=sys.stderr)  # as the interpreter reports sys.exit("message")
        status = ended.code if isinstance(ended.code, int) else 0 if ended.code is None else 1
    threading._shutdown()  # the interpreter's first step at exit: the threads that are not daemons
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
