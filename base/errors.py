"""Problems the user fixes (configuration, data, paths, checkpoints, weight files, a full
disk): one line on stderr and exit status 2, no traceback. ``--debug`` on the command line
keeps the traceback for a bug report. Plain Python, no torch: ``models.weights`` raises
the weight-file errors, and tools that load no weights catch them without importing torch."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

EXIT_USER_ERROR = 2
logger = logging.getLogger(__name__)


class WeightsError(ValueError):
    """A weight file that cannot be used (missing, unreadable, refused, or not fitting the
    model); the message says what to do. CLIs turn it into one line and exit status 2."""


class WeightsNotFoundError(WeightsError, FileNotFoundError):
    """The weight file does not exist."""


class CheckpointMismatchError(WeightsError):
    """The weights do not fit the model that was built for them."""


class UserError(ValueError):
    """A problem the user fixes (configuration, data, paths, checkpoints, a full disk), with
    a message that says what to change."""


class VideoDataError(UserError):
    """The data cannot feed training (empty, too many bad files); the message says what to do
    (a user's problem: one line and exit status 2 from the command-line tools).

    The message is ``reason``, what went wrong, then ``advice`` when there is some
    (``"{reason}. {advice}"``); a run that stops on the error quotes the reason alone.
    """

    def __init__(self, reason: str, advice: str = ""):
        super().__init__(f"{reason}. {advice}" if advice else reason)
        self.reason, self.advice = reason, advice


USER_ERRORS = (UserError, WeightsError)


def readable_size(size: float) -> str:
    """A byte count as the messages give it: GiB from 10 MiB up, MiB from 1 MiB, else KiB."""
    if size >= 10 * 2**20:
        return f"{size / 2**30:.2f} GiB"
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"


def counts_in_words(counts: dict[str, int]) -> str:
    """``{"too short": 2, "unreadable": 1}`` as "2 too short, 1 unreadable", most first."""
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items(), key=lambda item: -item[1]))


def debug_requested(argv: list[str] | None = None) -> bool:
    """``--debug`` among the command-line arguments: show tracebacks instead of one line."""
    return "--debug" in (sys.argv[1:] if argv is None else argv)


def exit_on_user_error(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> None:
    """Run a CLI entry point on ``argv`` (None: the command line); a user's problem exits
    with status 2 and its message, without a traceback (it is the user's to fix, not a
    crash), unless ``--debug`` was given."""
    try:
        main(argv)
    except USER_ERRORS as err:
        if debug_requested(argv):
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
