"""The launch commands ``make_annotations`` prints: training on the annotated clips, or on
the shards it packed (the from-scratch preset on one GPU, absolute paths: they work from any
folder)."""

from __future__ import annotations

import shlex
from pathlib import Path

from taehv_train.training.annotate.annotation_files import Annotated

REPOSITORY = Path(__file__).resolve().parents[2]
LAUNCH_SCRIPT = REPOSITORY / "train_taehv_h100.sh"


def launch_command(data_root: str, annotation_file: str, val_annotation_file: str) -> str:
    """The launch command that trains the from-scratch preset on one GPU on these data."""
    return shlex.join(
        [
            str(LAUNCH_SCRIPT),
            "1",
            "scratch",
            f"--data_root={data_root}",
            f"--annotation_file={annotation_file}",
            f"--val_annotation_file={val_annotation_file}",
        ]
    )


def train_command(annotated: Annotated) -> str:
    """The launch command that trains on the annotated clips, with absolute paths: it works
    from any folder."""
    val = annotated.paths["val"] if annotated.val else ""  # no validation set: the preset's is not used either
    return launch_command(
        str(Path(annotated.root).resolve()), str(annotated.paths["train"].resolve()), str(val and val.resolve())
    )


def shard_train_command(out: str, validation: bool) -> str:
    """The launch command that trains on the shards under ``out`` (their clips are their own
    annotation: no annotation file)."""
    return launch_command(f"{out}/train/*.tar", "", f"{out}/val/*.tar" if validation else "")
