"""The errors of weight files, without torch: command-line tools that load no weights
(``common.errors`` turns these into one line) start without importing it."""

from __future__ import annotations


class WeightsError(ValueError):
    """A weight file that cannot be used (missing, unreadable, refused, or not fitting the
    model); the message says what to do. CLIs turn it into one line and exit status 2."""


class WeightsNotFoundError(WeightsError, FileNotFoundError):
    """The weight file does not exist."""


class CheckpointMismatchError(WeightsError):
    """The weights do not fit the model that was built for them."""
