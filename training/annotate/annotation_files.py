"""The files ``make_annotations`` writes: the train and val annotations in the users' format
(each with the split it is a side of) and the skipped files with their reasons, the three
replaced together; and ``Annotated``, what a run wrote."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from taehv_train.base.atomic import atomic_write, atomic_write_all
from taehv_train.base.errors import UserError
from taehv_train.common.video.files import IMAGE_EXTENSIONS
from taehv_train.training.annotate.annotation_split import Split, held_out


def annotation_text(entries: Sequence[dict], split: Split | None = None) -> str:
    """Users' format, one clip per line so that large files stay diffable; with ``split``,
    the settings of the train/val split the file is a side of (readers take only "list")."""
    recorded = f'"split": {json.dumps(asdict(split))}, ' if split is not None else ""
    clips = ",\n".join(json.dumps(e, ensure_ascii=False) for e in entries)
    return f'{{"total": {len(entries)}, {recorded}"list": [\n{clips}\n]}}\n'


def write_annotation(path: Path, entries: Sequence[dict], split: Split | None = None) -> None:
    """Write ``annotation_text`` to ``path``; a failed write leaves the file there as it was."""
    atomic_write(path, annotation_text(entries, split))


def annotation_entry(record: dict, min_frames: int) -> tuple[dict | None, str | None]:
    """The annotation of a probe record, or why the file is skipped (``--min_frames`` is
    applied here, so that changing it needs no new probe)."""
    if "skip" in record:
        return None, record["skip"]
    info = record["probe"]
    if info["frames"] < min_frames:
        return None, f"too short: {info['frames']} decodable frames < --min_frames {min_frames}"
    entry: dict = {"path": record["path"], "full_path": info["full_path"], "frames": info["frames"]}
    if Path(info["full_path"]).suffix.lower() not in IMAGE_EXTENSIONS:  # a still image has no duration or fps
        entry["duration"] = round(info["frames"] / info["fps"], 3) if info["fps"] > 0 else None
        entry["fps"] = round(info["fps"], 3)
    entry["width"], entry["height"] = info["width"], info["height"]
    return entry, None


def output_paths(out: Path) -> dict[str, Path]:
    return {part: out.with_name(f"{out.stem}_{part}{out.suffix or '.json'}") for part in ("train", "val", "skipped")}


def write_outputs(
    paths: dict[str, Path], records: Iterable[dict], min_frames: int, split: Split, known: Mapping[str, bool]
) -> tuple[list[dict], list[dict], list[dict]]:
    """Write the train, val and skipped files from the probe records; return (train, val,
    skipped), each clip on its side of the split (``held_out``: a clip of a former split,
    ``known``, keeps its side). The files depend on the set of records and ``known``, not
    on the records' order or on the sharding."""
    kept, skipped = [], []
    for record in records:
        entry, reason = annotation_entry(record, min_frames)
        if entry is None:
            skipped.append({"path": record["path"], "reason": reason})
        else:
            kept.append(entry)
    kept.sort(key=lambda e: e["path"])  # workers finish in any order; the files do not depend on it
    skipped.sort(key=lambda s: s["path"])
    is_val = held_out([e["path"] for e in kept], split, known)
    train = [e for e, v in zip(kept, is_val) if not v]
    val = [e for e, v in zip(kept, is_val) if v]
    try:  # all three or none: a full disk leaves the former files whole and of one split
        atomic_write_all(
            {
                paths["train"]: annotation_text(train, split),
                paths["val"]: annotation_text(val, split),
                paths["skipped"]: json.dumps({"total": len(skipped), "list": skipped}, indent=1) + "\n",
            }
        )
    except OSError as err:  # read-only file system, no space, no permission: the user's to fix
        raise UserError(
            f"cannot write the annotations next to {paths['train']}: {err.strerror or err} "
            "(the files there are as they were)"
        ) from None
    return train, val, skipped


@dataclass(frozen=True)
class Annotated:
    """What ``annotate`` wrote: the files, their clips, and how the split was made."""

    root: Path
    paths: dict[str, Path]  # absolute
    records: str  # the probe records file(s), by name
    what: str  # "videos", or "videos and images"
    found: int
    train: list[dict]
    val: list[dict]
    skipped: list[dict]
    split_note: str
    problem: tuple[str, list[str]] | None  # split_problem's
