"""The data a run trains and validates on, recorded at its start, so that a resume notices
when it changed.

An annotation file (or a scanned folder) can change under a stopped run: clips added to
the folder and annotated again (the launch script's ``--data`` re-annotates on every
start), or another run's ``--data`` on the same folder. A resume that read it again would
train on other clips, and score validations on another validation set, under the same
run. So each checkpoint records, per part (``train``, ``val``), the clips read at the
run's start: their count and a hash of their paths and frame counts, read the way the
datasets read them (``common.clip_table.ClipTable.from_source``). A resume compares, and
refuses a change unless ``allow_data_change`` is given (``training.state.run_config``).
"""

from __future__ import annotations

import hashlib

from taehv_train.base.errors import UserError
from taehv_train.common.clip_table import ClipTable
from taehv_train.common.config import TrainConfig

PART_NAMES = {"train": "training", "val": "validation"}


def data_record(config: TrainConfig) -> dict[str, dict]:
    """Per part, the source, the clip count and the hash of the clips ``config`` reads (no
    ``val`` without a validation set)."""
    sources = {"train": config.annotation_file}
    if config.val_annotation_file and config.num_validation_samples > 0:
        sources["val"] = config.val_annotation_file
    record = {}
    for part, annotation_file in sources.items():
        try:
            table, source = ClipTable.from_source(config.data_root or None, annotation_file or None)
        except (OSError, ValueError, KeyError, TypeError) as err:  # not an annotation file: the user's to fix
            where = annotation_file or config.data_root
            raise UserError(f"cannot read the {PART_NAMES[part]} clips of {where}: {err}") from err
        digest = hashlib.sha256()
        for array in (table.offsets, table.path_bytes, table.frames):
            digest.update(array.tobytes())
        record[part] = {"source": source, "clips": len(table), "sha256": digest.hexdigest()}
    return record


def data_changes(saved: dict[str, dict], now: dict[str, dict]) -> list[str]:
    """What differs between the clips a run recorded (``saved``) and those read now, in
    words ("training clips 7 -> 16 (demo/annotations_train.json)"); empty when nothing did."""
    changes = []
    for part, name in PART_NAMES.items():
        before, after = saved.get(part), now.get(part)
        if before is None and after is None:
            continue
        if before is None or after is None:
            changes.append(f"{name} set {'added' if before is None else 'removed'}")
        elif before["sha256"] != after["sha256"]:
            count = (
                f"{before['clips']} -> {after['clips']}"
                if before["clips"] != after["clips"]
                else f"{after['clips']}, others than before"
            )
            changes.append(f"{name} clips {count} ({after['source']})")
    return changes


def validation_changed(saved: dict[str, dict], now: dict[str, dict]) -> bool:
    """Whether the validation clips differ: scores before and after cannot be compared."""
    before, after = saved.get("val"), now.get("val")
    return (before or {}).get("sha256") != (after or {}).get("sha256")
