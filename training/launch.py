"""``accelerate launch`` as the launch script runs it, with training's own ending kept.

    python -m training.launch [accelerate launch options] -m training.taehv_train --config ...

When a training process ends on purpose with a non-zero status (a one-line user error
such as the data going away, or too many skipped steps), accelerate's launcher adds a
traceback and a failure table of its own; when a scheduler signals the whole job, the
launcher exits non-zero even though training saved and stopped cleanly. Training's rank 0
writes its exit status to ``TAEHV_EXIT_STATUS_FILE``; this wrapper exits with that status,
without the launcher's report. A process that crashed (wrote no status) keeps the full
report.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from accelerate.commands.launch import launch_command, launch_command_parser
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError


def main(argv: list[str] | None = None) -> None:
    args = launch_command_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="taehv_launch_") as folder:
        status_file = Path(folder) / "exit_status"
        os.environ["TAEHV_EXIT_STATUS_FILE"] = str(status_file)
        try:
            launch_command(args)
        except (ChildFailedError, SignalException) as err:
            reported = int(status_file.read_text()) if status_file.is_file() else None
            if reported is None or (reported == 0 and isinstance(err, ChildFailedError)):
                raise  # a crash, not an ending training chose: the launcher's report is the information
            sys.exit(reported)


if __name__ == "__main__":
    main()
