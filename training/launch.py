"""``accelerate launch`` as the launch script runs it, with training's own ending kept.

    python -m taehv_train.training.launch [accelerate launch options] -m taehv_train.training.taehv_train --config ...

When a training process ends on purpose with a non-zero status (a one-line user error
such as the data going away, or too many skipped steps), accelerate's launcher adds a
traceback and a failure table of its own; when a scheduler signals the whole job, the
launcher exits non-zero even though training saved and stopped cleanly. Training writes
its exit status to ``TAEHV_EXIT_STATUS_FILE``; this wrapper exits with that status,
without the launcher's report.

When a training process dies of a signal (``kill -9``, the out-of-memory killer, a
segfault), the others lose contact with it and stop (exit status 3, one line each); this
wrapper then ends with one line, on stderr and in the run's ``train.log``: ``error: rank
1 died (signal 9, SIGKILL: ...): resume with: <command>``, and exits 128 + the signal
(137 for SIGKILL), as a shell reports a process killed by it. A process that ended with
its own explained status on another rank than the first (out of memory in its optimizer
step, exit 4) ends the wrapper with that status and one such line. Training tells the wrapper
its run folder in ``TAEHV_RUN_DIR_FILE``. An ending training chose and explained (a user
error, too many skipped steps) wins over a process that dies after it, on its way out.

When this launcher dies without passing a signal on (``kill -9``, the out-of-memory
killer), the training processes, which torch elastic starts in sessions of their own, end
with it (``common.lifeline``; it names itself to them in ``TAEHV_LAUNCHER_PID``).

A process that crashed otherwise keeps the launcher's full report. Torch elastic's own log
lines are held while the launch runs: left out where one line says how the run ended,
printed at the end otherwise (before the launcher's report of a crash).
"""

from __future__ import annotations

import os
import time

if __name__ == "__main__":  # the run's clock starts here: a time budget counts the launcher's start-up too
    os.environ.setdefault("TAEHV_STARTED_AT", repr(time.time()))

import contextlib
import logging
import shlex
import signal
import sys
import tempfile
from collections.abc import Iterator
from logging.handlers import BufferingHandler
from pathlib import Path

from accelerate.commands.launch import launch_command, launch_command_parser
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from taehv_train.base.errors import EXIT_USER_ERROR
from taehv_train.base.process_exit import exit_without_teardown
from taehv_train.common.lifeline import LAUNCHER_PID
from taehv_train.training.loop.resilience import EXIT_OUT_OF_MEMORY, EXIT_RANK_LOST
from taehv_train.training.state.commands import next_command


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = launch_command_parser().parse_args(argv)
    # the command the ranks' messages and this wrapper's print to resume the run (the launch script sets its own)
    os.environ.setdefault(
        "TAEHV_LAUNCH_COMMAND", shlex.join([sys.executable, "-m", "taehv_train.training.launch", *argv])
    )
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the training processes end with this process
    with tempfile.TemporaryDirectory(prefix="taehv_launch_") as folder, elastic_log_held() as held:
        status_file, run_dir_file = Path(folder) / "exit_status", Path(folder) / "run_dir"
        os.environ["TAEHV_EXIT_STATUS_FILE"], os.environ["TAEHV_RUN_DIR_FILE"] = str(status_file), str(run_dir_file)
        try:
            launch_command(args)
        except (ChildFailedError, SignalException) as err:
            reported = int(status_file.read_text()) if status_file.is_file() else None
            if reported not in (None, 0, EXIT_RANK_LOST):
                # an ending training chose and explained (a user error, too many skipped steps): a process that
                # then dies on its way out (an abort in a library's exit handlers) changes nothing about it
                sys.exit(reported)
            run_dir = Path(run_dir_file.read_text()) if run_dir_file.is_file() else None
            if isinstance(err, ChildFailedError) and (death := died(err)) is not None:
                sys.exit(report_death(*death, run_dir))
            if isinstance(err, ChildFailedError) and (ending := explained_ending(err)) is not None:
                sys.exit(report_ending(*ending, run_dir))
            if reported in (None, EXIT_RANK_LOST) or (reported == 0 and isinstance(err, ChildFailedError)):
                held.replay()
                raise  # a crash, not an ending training chose: the launcher's report is the information
            sys.exit(reported)
        held.replay()


class HeldRecords(BufferingHandler):
    """Log records kept until the launch ends, then replayed or dropped."""

    def __init__(self, logger: logging.Logger):
        super().__init__(capacity=sys.maxsize)
        self.logger = logger

    def replay(self) -> None:
        """Emit the held records through the handlers the logger had before."""
        for record in self.buffer:
            self.logger.parent.handle(record)
        self.buffer.clear()


@contextlib.contextmanager
def elastic_log_held() -> Iterator[HeldRecords]:
    """Torch elastic's log lines (e.g. "Sending process ... closing signal SIGTERM", "failed
    (exitcode: -9)"), which it writes as the run ends, held instead of printed."""
    elastic = logging.getLogger("torch.distributed.elastic")
    held, propagate = HeldRecords(elastic), elastic.propagate
    elastic.addHandler(held)
    elastic.propagate = False
    try:
        yield held
    finally:
        elastic.removeHandler(held)
        elastic.propagate = propagate


def died(err: ChildFailedError) -> tuple[int, int] | None:
    """(rank, signal) of the process whose death by a signal ended the run: the first
    failure the launcher saw (ties in time broken by the order it saw them), passing over
    the processes that only lost contact with it; None when that one did not die of a signal."""
    failures = {rank: failure for rank, failure in err.failures.items() if failure.exitcode != EXIT_RANK_LOST}
    if not failures:
        return None
    rank = min(failures, key=lambda r: failures[r].timestamp)
    exitcode = failures[rank].exitcode
    return (rank, -exitcode) if exitcode < 0 else None


# endings a training process explains in its own line, on whichever rank they happen
EXPLAINED_ENDINGS = {
    EXIT_USER_ERROR: "a problem to fix, said above",
    EXIT_OUT_OF_MEMORY: "out of memory in its optimizer step",
}


def explained_ending(err: ChildFailedError) -> tuple[int, int] | None:
    """(rank, exit status) of the process whose explained ending (``EXPLAINED_ENDINGS``)
    ended the run, when another rank than the first wrote it: the first failure the
    launcher saw, passing over the processes that only lost contact with it."""
    failures = {rank: failure for rank, failure in err.failures.items() if failure.exitcode != EXIT_RANK_LOST}
    if not failures:
        return None
    rank = min(failures, key=lambda r: failures[r].timestamp)
    return (rank, failures[rank].exitcode) if failures[rank].exitcode in EXPLAINED_ENDINGS else None


def report_ending(rank: int, status: int, run_dir: Path | None) -> int:
    """One line on stderr and in the run's train.log (the rank's own line went to stderr
    only); returns the rank's exit status."""
    return report(
        f"error: rank {rank} ended with status {status} ({EXPLAINED_ENDINGS[status]}): {next_command(run_dir)}",
        run_dir,
        status,
    )


def report_death(rank: int, signum: int, run_dir: Path | None) -> int:
    """One line on stderr and, when the run folder is known, in its train.log: which process
    died of which signal and the command that goes on; returns the exit status, 128 + the
    signal."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = "unknown"
    how = ": kill -9 or out of memory, see dmesg" if signum == signal.SIGKILL else ""  # the kernel's OOM killer
    return report(
        f"error: rank {rank} died (signal {signum}, {name}{how}): {next_command(run_dir)}", run_dir, 128 + signum
    )


def report(line: str, run_dir: Path | None, status: int) -> int:
    """``line`` on stderr and, when the run folder is known, in its train.log; returns ``status``."""
    print(line, file=sys.stderr)
    if run_dir is not None and (run_dir / "train.log").is_file():
        with open(run_dir / "train.log", "a") as log:
            log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} [launcher] ERROR training.launch: {line}\n")
    return status


if __name__ == "__main__":
    with exit_without_teardown():
        main()
