"""Reading what a training run leaves on disk: training writes it, ``inference.py`` and the
export bundle read it.

A checkpoint (or ``best_model``) folder holds a manifest, ``checkpoint.json``, listing every
file with its size and CRC-32 (``training.state.checkpoints`` writes it). A weight file
inside such a folder is trusted only once the manifest vouches for it (``verified_weights``);
a run folder is the one that holds the run's ``config.json`` (``run_folder_of``).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from common.errors import UserError
from models.weights import find_weights

CHECKPOINT_MANIFEST = "checkpoint.json"


class DamagedCheckpointError(UserError):
    """A checkpoint whose files are missing, of the wrong size or fail their checksum."""


def file_checksum(path: Path, chunk: int = 8 << 20) -> str:
    """CRC-32 of a file as 8 hex digits: catches damaged bytes at several GB/s, so that
    verifying a checkpoint costs little next to writing it (see docs/fault_tolerance.md)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def read_checkpoint_manifest(path: Path, verify_checksums: bool = False) -> dict:
    """The manifest of a complete checkpoint; DamagedCheckpointError (a UserError) if it
    is missing, a file is absent or of the wrong size, or (``verify_checksums``) a file's
    content differs from what was saved."""
    manifest_file = path / CHECKPOINT_MANIFEST
    if not manifest_file.is_file():
        raise DamagedCheckpointError(
            f"checkpoint {path} is incomplete (no {CHECKPOINT_MANIFEST}): it was being written when the run "
            "stopped, or comes from an older version"
        )
    manifest = json.loads(manifest_file.read_text())
    entries = {
        name: entry if isinstance(entry, dict) else {"size": entry}  # older manifests: sizes only
        for name, entry in manifest["files"].items()
    }
    missing = [
        name
        for name, entry in entries.items()
        if not (path / name).is_file() or (path / name).stat().st_size != entry["size"]
    ]
    if missing:
        raise DamagedCheckpointError(f"{path.name} is damaged ({', '.join(missing[:3])} missing or of the wrong size)")
    if verify_checksums:
        changed = [
            name for name, entry in entries.items() if "crc32" in entry and file_checksum(path / name) != entry["crc32"]
        ]
        if changed:
            raise DamagedCheckpointError(f"{path.name} is damaged ({', '.join(changed[:3])} checksum)")
    return manifest


def verified_weights(path: str | Path) -> Path:
    """The weight file behind ``path`` (``models.weights.find_weights``); inside a checkpoint
    or ``best_model`` folder, only once its manifest's checksums vouch for the folder's files."""
    weights = find_weights(path)
    if (weights.parent / CHECKPOINT_MANIFEST).is_file():
        try:
            read_checkpoint_manifest(weights.parent, verify_checksums=True)
        except DamagedCheckpointError as err:
            raise DamagedCheckpointError(f"{err}: {weights} cannot be trusted; use another checkpoint") from None
    return weights


def run_folder_of(weights: Path) -> Path | None:
    """The training run that wrote ``weights`` (its folder holds ``config.json``): next to
    ``final_model.*``, one level above ``best_model/``, two above ``checkpoints/checkpoint-N/``;
    None for a file from elsewhere."""
    folder = weights.parent
    if weights.name.startswith("final_model"):
        run = folder
    elif folder.name == "best_model":
        run = folder.parent
    elif folder.parent.name == "checkpoints":
        run = folder.parent.parent
    else:
        return None
    return run if (run / "config.json").is_file() else None


# -- whether a run is finished: finished.json, written by training at its end -------------

FINISHED = "finished.json"
FINISHED_REASONS = ("finished", "early_stop")


def finished_info(run: Path) -> dict | None:
    """What ``run``'s end recorded (``step``, ``reason``, ``max_train_steps``) when it is
    finished, else None. A marker with another reason (a finished run being extended) means
    unfinished. A run from before the marker counts as finished when its
    ``final_model.safetensors`` is newer than its newest checkpoint: training writes the
    final model only after the last checkpoint."""
    marker = run / FINISHED
    if marker.is_file():
        info = json.loads(marker.read_text())
        return info if info.get("reason") in FINISHED_REASONS else None
    final = run / "final_model.safetensors"
    steps = [
        (int(p.name.removeprefix("checkpoint-")), p)
        for p in (run / "checkpoints").glob("checkpoint-*")
        if p.name.removeprefix("checkpoint-").isdigit() and (p / CHECKPOINT_MANIFEST).is_file()
    ]
    if not final.is_file() or not steps:
        return None
    step, newest = max(steps)
    if final.stat().st_mtime <= (newest / CHECKPOINT_MANIFEST).stat().st_mtime:
        return None
    return {"step": step, "reason": "finished"}


def write_run_marker(run: Path, info: dict) -> None:
    """Record how ``run`` ended (``reason`` "finished"/"early_stop") or that a finished run
    is being extended (``reason`` "extending": unfinished again until its new end)."""
    from models.atomic import atomic_write

    atomic_write(run / FINISHED, json.dumps(info, indent=1))
