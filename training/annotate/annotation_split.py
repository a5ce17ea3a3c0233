"""The train/val split of annotated clips: whole source groups on one side, kept across re-runs.

The group of a clip is the first match of ``--group_regex`` on its path relative to DIR;
the groups go to validation in a seeded hash order while that brings the held-out share
closer to ``--val_fraction``. The annotation files record the split's settings, so a
re-run keeps each known clip's side and refuses other settings that would move held-out
clips into training (``kept_sides``); ``split_problem`` says why a split left one side
empty and which flags give both sides clips.
"""

from __future__ import annotations

import hashlib
import math
import re
import shlex
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from taehv_train.base.errors import UserError
from taehv_train.common.annotation_file import AnnotationFileError, read_annotation

DEFAULT_GROUP_REGEX = r"^(?:.*/)?[^_./]+"


def group_key(rel_path: str, pattern: re.Pattern[str] | None) -> str:
    """The source a clip comes from; the whole path when there is no pattern or match."""
    match = pattern.search(rel_path) if pattern is not None else None
    return match.group(0) if match else rel_path


def split_train_val(
    keys: Sequence[str], val_fraction: float, seed: int, known: Mapping[str, bool] | None = None
) -> list[bool]:
    """``is_val`` per item. The groups in ``known`` keep their side (a former split of the
    same files); the others, in a seeded hash order, go to validation while that brings
    the validation size closer to ``val_fraction`` of all items."""
    known = known or {}
    sizes = Counter(keys)
    val_groups = {k for k in sizes if known.get(k)}
    val_size = sum(sizes[k] for k in val_groups)
    order = sorted(
        (k for k in sizes if k not in known), key=lambda k: hashlib.sha256(f"{seed}:{k}".encode()).hexdigest()
    )
    target = val_fraction * len(keys)
    for key in order:
        if abs(val_size + sizes[key] - target) < abs(val_size - target):
            val_groups.add(key)
            val_size += sizes[key]
    return [k in val_groups for k in keys]


@dataclass(frozen=True)
class Split:
    """The settings of a train/val split. The annotation files record them (their "split"
    key), so that a re-run with other settings is caught before it moves held-out clips
    into the training set of runs that use the files."""

    val_fraction: float
    seed: int
    group_regex: str

    @property
    def pattern(self) -> re.Pattern[str] | None:
        return re.compile(self.group_regex) if self.group_regex else None

    def flags(self, names: Iterable[str] = ("val_fraction", "seed", "group_regex")) -> str:
        """The command-line flags of these settings (of ``names`` only)."""
        text = {"val_fraction": f"{self.val_fraction:g}", "seed": str(self.seed), "group_regex": self.group_regex}
        return " ".join(f"--{name} {shlex.quote(text[name])}" for name in names)

    def differences(self, other: Split) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


@dataclass(frozen=True)
class RecordedSplit:
    """The split in the train and val files a former run wrote next to ``-o``."""

    split: Split | None  # None: files written before the settings were recorded
    sides: dict[str, bool]  # path -> held out for validation
    val_file: Path

    @property
    def held_out(self) -> int:
        return sum(self.sides.values())


def recorded_split(paths: dict[str, Path]) -> RecordedSplit | None:
    """The split the train and val files next to ``-o`` hold; None when neither exists."""
    sides: dict[str, bool] = {}
    split = None
    for part in ("train", "val"):
        if not (path := paths[part]).is_file():
            continue
        try:
            data = read_annotation(path)
            sides |= {entry["path"]: part == "val" for entry in data["list"]}
            if "split" in data:
                values = data["split"]
                split = Split(float(values["val_fraction"]), int(values["seed"]), str(values["group_regex"]))
        except AnnotationFileError as err:  # damaged (a cut-off write by another tool, an edit)
            raise UserError(f"{err}; pass --resplit to split anew, or another -o") from None
        except (ValueError, KeyError, TypeError) as err:  # a shape of its own: not written by this tool
            raise UserError(
                f"cannot read the split in {path} ({type(err).__name__}: {err}): pass --resplit to split anew, "
                "or another -o"
            ) from None
    if not any(paths[part].is_file() for part in ("train", "val")):
        return None
    return RecordedSplit(split, sides, paths["val"])


def kept_sides(recorded: RecordedSplit | None, split: Split, resplit: bool) -> tuple[dict[str, bool], str]:
    """The side of each clip of a former split that this run keeps, and how the split is
    made, in words. Known clips keep their side under the same settings, or under settings
    the files do not record; other settings split anew when nothing was held out, and are
    refused otherwise (unless ``resplit``): a new split would move held-out clips into the
    training set of the runs that use the files."""
    if resplit:
        return {}, f"split anew (--resplit) by {split.flags()}"
    if recorded is None:
        return {}, f"split by {split.flags()}; recorded in the files: a re-run keeps each clip's side"
    if recorded.split == split:
        return recorded.sides, f"split by {split.flags()} as recorded: known clips keep their side, new ones are split"
    if not recorded.held_out:
        return {}, f"split anew by {split.flags()} (the former split held no clip out)"
    if recorded.split is None:
        return recorded.sides, (
            f"{recorded.val_file.name} records no split settings (an older make_annotations wrote it): "
            f"its {count(recorded.held_out, 'clip')} stay held out, new clips are split by {split.flags()}; "
            "--resplit splits them all anew"
        )
    changed = recorded.split.differences(split)
    raise UserError(
        f"{recorded.val_file.name} holds {count(recorded.held_out, 'clip')} held out by a split with "
        f"{recorded.split.flags()}: splitting with {split.flags(changed)} instead would move held-out clips "
        "into the training set of runs that use these files; pass --resplit to split anew, or another -o"
    )


def count(n: int, noun: str) -> str:
    """``n`` ``noun``s in words: "1 clip", "3 clips"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def held_out(paths: Sequence[str], split: Split, known: Mapping[str, bool]) -> list[bool]:
    """``is_val`` per clip of ``paths``: a clip of a former split (``known``: path -> held
    out) keeps its side, a new clip of a known group joins it (held out when any clip of
    the group is), and the new groups are split."""
    pattern = split.pattern
    known_groups: dict[str, bool] = {}
    for path, was_held_out in known.items():
        key = group_key(path, pattern)
        known_groups[key] = known_groups.get(key, False) or was_held_out
    keys = [group_key(path, pattern) for path in paths]
    by_group = split_train_val(keys, split.val_fraction, split.seed, known_groups)
    return [known.get(path, side) for path, side in zip(paths, by_group)]


def split_problem(paths: Sequence[str], split: Split, n_val: int) -> tuple[str, list[str]] | None:
    """Why the split of ``paths`` that held ``n_val`` of them out leaves the validation or
    the training side empty while ``--val_fraction`` > 0, and the flags that give both
    sides clips ([] when none can: a single clip); None when the split is usable."""
    pattern, val_fraction, seed = split.pattern, split.val_fraction, split.seed
    keys = [group_key(p, pattern) for p in paths]
    if val_fraction == 0 or 0 < n_val < len(paths):
        return None
    side = "validation" if n_val == 0 else "training"
    if len(paths) == 1:
        return f"the {side} file is empty: a single clip cannot be split", []
    groups = Counter(keys)
    if len(groups) == 1:
        why = f"all {len(paths)} clips are in one group, {keys[0]!r}"
    elif n_val:
        why = f"--val_fraction {val_fraction:g} puts all {len(groups)} groups of the {len(paths)} clips in validation"
    else:
        smallest = min(groups, key=lambda k: (groups[k], k))
        why = (
            f"the smallest of the {len(groups)} groups, {smallest!r}, has {groups[smallest]} of the {len(paths)} "
            f"clips, more than the ~{val_fraction * len(paths):.1f} that --val_fraction {val_fraction:g} asks for"
        )
    message = f"the {side} file is empty: {why}, and each group stays on one side of the split"
    fraction = 0.1 if n_val else max(val_fraction, math.ceil(100 / len(paths)) / 100)
    for flags, new_pattern, new_fraction in (
        (["--group_regex", ""], None, val_fraction),
        (["--val_fraction", f"{fraction:g}"], pattern, fraction),
        (["--group_regex", "", "--val_fraction", f"{fraction:g}"], None, fraction),
    ):
        keys = [group_key(p, new_pattern) for p in paths]
        if new_fraction < 1 and 0 < sum(split_train_val(keys, new_fraction, seed)) < len(paths):
            return message, flags
    return message, []
