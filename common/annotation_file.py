"""Reading an annotation file (the users' format ``{"total": N, "list": [{"path" |
"full_path", "frames", ...}]}``): one check of its shape for every reader (training's
pre-flight and datasets, ``inference.py``, ``make_annotations``' re-runs), so that a
truncated, damaged or hand-edited file is one line naming the file and the first bad entry
wherever it is read, before any run folder exists.

The shape is checked here; the meaning of an entry's values (a ``frames`` that is no
positive whole number, a path that leaves the root) is ``ClipTable.from_annotation``'s:
such an entry is left out and reported, not fatal.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from taehv_train.base.errors import UserError

PATH_KEYS = ("path", "full_path")
FORMAT = '{"total": N, "list": [{"path": ..., "frames": ...}, ...]}'


class AnnotationFileError(UserError):
    """An annotation file that cannot be read as one: the message names the file and, where
    one is at fault, the entry (its index and path)."""


def json_kind(value: object) -> str:
    """What a parsed JSON value is, in the words of the JSON format."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    kinds = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}
    return kinds.get(type(value), type(value).__name__)


def _entry_problem(entry: object) -> str | None:
    """Why ``entry`` is no clip of the users' format; None when it is one."""
    if not isinstance(entry, dict):
        return f"is {json_kind(entry)}, not an object with a 'path'"
    present = [key for key in PATH_KEYS if key in entry]
    if not present:
        return f"has neither 'path' nor 'full_path' ({json.dumps(entry)[:80]})"
    for key in present:
        if not isinstance(entry[key], str) or not entry[key]:
            return f"has {key}={json.dumps(entry[key])[:80]}, not a file path"
    return None


def read_annotation(path: str | os.PathLike) -> dict:
    """The annotation document at ``path``: a JSON object whose ``"list"`` is a list of
    objects, each with a non-empty string ``path`` or ``full_path``. AnnotationFileError,
    naming the file and the first bad entry (index and path) with the count of the others,
    when it is none: unreadable, not UTF-8 JSON (truncated or binary), or of another shape."""
    path = Path(path)
    where = f"annotation file {path}"
    try:
        document = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as err:
        raise AnnotationFileError(f"cannot read the {where}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise AnnotationFileError(f"the {where} is not UTF-8 text (a binary file?): expected {FORMAT}") from None
    except json.JSONDecodeError as err:
        raise AnnotationFileError(
            f"the {where} is no valid JSON ({err.msg}: line {err.lineno} column {err.colno}; truncated?): "
            "write it again, e.g. with `python -m taehv_train.training.make_annotations DIR -o FILE`"
        ) from None
    if not isinstance(document, dict):
        raise AnnotationFileError(f"the {where} holds {json_kind(document)}, not an object: expected {FORMAT}")
    if "list" not in document:
        raise AnnotationFileError(f"the {where} has no 'list' of clips: expected {FORMAT}")
    entries = document["list"]
    if not isinstance(entries, list):
        raise AnnotationFileError(f"in the {where}, 'list' is {json_kind(entries)}, not a list of clips")
    bad = [(i, problem) for i, entry in enumerate(entries) if (problem := _entry_problem(entry)) is not None]
    if bad:
        i, problem = bad[0]
        entry = entries[i]
        named = next((entry[k] for k in PATH_KEYS if isinstance(entry, dict) and isinstance(entry.get(k), str)), None)
        others = f" (and {len(bad) - 1} more bad {'entry' if len(bad) == 2 else 'entries'})" if len(bad) > 1 else ""
        raise AnnotationFileError(
            f"{where}: entry {i}{f' ({named})' if named else ''} {problem}{others}: expected {FORMAT}"
        )
    return document
