"""User mistakes (config, data, paths, checkpoints): one line and exit status 2, no traceback."""
from __future__ import annotations

import sys
from collections.abc import Callable

EXIT_CONFIG_ERROR = 2


class ConfigError(ValueError):
    """A configuration problem, with a message that says what to change."""


def exit_on_config_error(main: Callable[[], object]) -> None:
    """Run a CLI entry point; a configuration problem exits with status 2 and its message,
    without a traceback (it is the user's to fix, not a crash)."""
    try:
        main()
    except ConfigError as err:
        print(f"configuration error: {err}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
