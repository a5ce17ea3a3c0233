"""Command-line flags: every tool documents them in snake_case (``--n_frames``, like the
config keys) and accepts the kebab-case spelling too (``--n-frames``)."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence


def _normal(flag: str) -> str:
    return flag[2:].replace("-", "_")


class BooleanFlag(argparse.BooleanOptionalAction):
    """``--x`` / ``--no_x``: argparse's ``BooleanOptionalAction`` in snake_case (its own
    negative is ``--no-x``, which is still accepted)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.option_strings = ["--no_" + flag[5:] if flag.startswith("--no-") else flag for flag in self.option_strings]

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.option_strings:
            setattr(namespace, self.dest, not option_string.startswith("--no_"))


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose long flags take both spellings (a
    ``BooleanOptionalAction`` becomes a ``BooleanFlag``). ``parse_known_args`` passes
    arguments the parser does not know (``--key=value`` config overrides) on as given;
    ``parse_args`` refuses them, naming the closest flag."""

    def _long_flags(self) -> dict[str, str]:
        return {
            _normal(flag): flag for action in self._actions for flag in action.option_strings if flag.startswith("--")
        }

    def parse_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            known = self._long_flags()
            flag = next((arg for arg in unknown if arg.startswith("--")), None)
            close = difflib.get_close_matches(_normal(flag.partition("=")[0]), known, n=1) if flag else []
            hint = f"; did you mean {known[close[0]]}?" if close else ""
            self.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
        return parsed

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", argparse.BooleanOptionalAction, BooleanFlag)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        args = list(sys.argv[1:] if args is None else args)
        known = self._long_flags()
        spelled = []
        for i, arg in enumerate(args):
            if arg == "--":  # everything after it is positional
                spelled += args[i:]
                break
            name, equals, value = arg.partition("=")
            if name.startswith("--") and name not in known.values() and _normal(name) in known:
                arg = known[_normal(name)] + equals + value
            spelled.append(arg)
        return super().parse_known_args(spelled, namespace)
