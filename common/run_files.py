"""Reading what a training run leaves on disk: training writes it, ``inference.py`` and the
export bundle read it.

A checkpoint (or ``best_model``) folder holds a manifest, ``checkpoint.json``, listing every
file with its size and CRC-32 (``training.state.atomic_folders`` writes it). A weight file
inside such a folder is trusted only once the manifest vouches for it (``verified_weights``);
a run folder is the one that holds the run's ``config.json`` (``run_folder_of``). The tools
read a run that may still be training: given an ``ExitStack``, ``run_weights`` holds the
checkpoint or ``best_model`` folder it chose (``common.folder_locks``) until the stack
closes, so that the run's rotation cannot delete it while it is verified and loaded.
"""

from __future__ import annotations

import json
import logging
import re
import zlib
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from taehv_train.base.atomic import atomic_write
from taehv_train.base.errors import UserError
from taehv_train.common.folder_locks import CHECKPOINT_MANIFEST, hold_for_reading
from taehv_train.models.weights import find_weights, run_folder

CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
CHECKPOINT_WEIGHTS = "weights.safetensors"  # the model inside a checkpoint or best_model folder
FINAL_MODELS = ("final_model.safetensors", "final_model.pth")
logger = logging.getLogger(__name__)


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


def verified_weights(path: str | Path, held: ExitStack | None = None) -> Path:
    """The weight file behind ``path`` (``models.weights.find_weights``); inside a checkpoint
    or ``best_model`` folder, only once its manifest's checksums vouch for the folder's files
    (with ``held``, verified once the folder is held for the rest of ``held``)."""
    weights = find_weights(path)
    if (weights.parent / CHECKPOINT_MANIFEST).is_file():
        if held is not None:
            handle = hold_for_reading(weights.parent)
            if handle is None:
                raise DamagedCheckpointError(
                    f"{weights.parent} was removed or replaced as it was being read (its run is still training): "
                    "give the run folder for its newest checkpoint (--weights final) or its best model"
                )
            held.enter_context(handle)
        try:
            read_checkpoint_manifest(weights.parent, verify_checksums=True)
        except DamagedCheckpointError as err:
            raise DamagedCheckpointError(f"{err}: {weights} cannot be trusted; use another checkpoint") from None
    return weights


def newest_intact(checkpoints: list[Path]) -> Path | None:
    """The newest of ``checkpoints`` (oldest first) whose manifest's checksums hold;
    incomplete or damaged ones are logged and passed over."""
    for checkpoint in reversed(checkpoints):
        try:
            read_checkpoint_manifest(checkpoint, verify_checksums=True)
        except DamagedCheckpointError as err:
            logger.warning("skipping %s", err)
            continue
        return checkpoint
    return None


READ_TRIES = 5  # a folder removed or replaced before its lock: the tools look again, this often


def newest_intact_checkpoint(run: Path, held: ExitStack | None = None) -> Path | None:
    """The newest intact checkpoint of ``run``, or None; held for the rest of ``held``
    (the rotation of a run still training keeps it), verified once held."""
    if held is None:
        return newest_intact(_checkpoints_of(run))
    for _ in range(READ_TRIES):
        for checkpoint in reversed(_checkpoints_of(run)):
            handle = hold_for_reading(checkpoint)
            if handle is None and not checkpoint.exists():  # rotated away since the listing: newer ones came
                break
            if handle is None:
                logger.warning("skipping %s: it has no %s", checkpoint, CHECKPOINT_MANIFEST)
                continue
            if newest_intact([checkpoint]) is None:
                handle.close()
                continue
            held.enter_context(handle)
            return checkpoint
        else:
            return None
    raise _kept_changing(run / "checkpoints")


def _checkpoints_of(run: Path) -> list[Path]:
    """The checkpoint folders of ``run``, oldest first."""
    steps = {}
    for folder in (run / "checkpoints").glob("checkpoint-*"):
        if folder.is_dir() and (match := CHECKPOINT_NAME.match(folder.name)):
            steps[folder] = int(match.group(1))
    return sorted(steps, key=steps.get)


def _kept_changing(folder: Path) -> UserError:
    return UserError(f"{folder} was replaced {READ_TRIES} times while it was being read: try again")


BEST, FINAL = "best", "final"
WEIGHT_CHOICES = (BEST, FINAL)  # the tools' --weights: which of a run folder's weights they take
BEST_MODEL = "best_model"
HISTORY = "validation_history.json"


@dataclass(frozen=True)
class RunWeights:
    """The weights a tool takes, their training step when they come from a run, and the one
    line that says which they are (no local paths: the run by its name), with the run
    folder's other choice of ``--weights`` in ``choice``, for the tools to add."""

    path: Path
    step: int | None = None
    line: str | None = None
    choice: str = ""

    @property
    def told(self) -> str | None:
        """The line the tools print."""
        return f"{self.line}; {self.choice}" if self.choice else self.line


def validation_history(run: Path) -> list[dict]:
    """Every validation of ``run`` (step and metrics), oldest first; empty without validation."""
    history = run / HISTORY
    return json.loads(history.read_text()) if history.is_file() else []


def best_model_weights(run: Path, held: ExitStack | None = None) -> Path | None:
    """The weights of ``run``'s best validation (``best_model/``, verified, held for the rest
    of ``held``: a new best waits to replace it); None for a run that has not validated.
    What a run folder stands for unless the final weights are asked for."""
    best = run / BEST_MODEL / CHECKPOINT_WEIGHTS
    for _ in range(READ_TRIES):
        if not best.is_file():
            return None
        if held is None or not (best.parent / CHECKPOINT_MANIFEST).is_file():  # a folder from before manifests
            return verified_weights(best)
        handle = hold_for_reading(best.parent)
        if handle is not None:  # else replaced before the lock: the new one
            held.enter_context(handle)
            return verified_weights(best)
    raise _kept_changing(run / BEST_MODEL)


def _score(run: Path, step: int | None) -> str:
    """The validation score of ``run`` at ``step``, in words."""
    config = json.loads((run / "config.json").read_text())
    metric = config.get("best_metric", "val/psnr")
    entry = next((h for h in validation_history(run) if h["step"] == step), None)
    return f"{metric} {entry[metric]:.4g}" if entry and metric in entry else "not validated at that step"


def _step_of(weights: Path, run: Path) -> int | None:
    """The training step ``weights`` of ``run`` hold, when the run recorded it."""
    if weights.parent.name == BEST_MODEL:
        info = weights.parent / "model_info.json"
        return json.loads(info.read_text())["step"] if info.is_file() else None
    if match := CHECKPOINT_NAME.match(weights.parent.name):
        return int(match.group(1))
    info = finished_info(run)
    return info.get("step") if info else None


def _final_weights(run: Path, held: ExitStack | None) -> tuple[Path | None, int | None, str]:
    """The run's latest weights, their step, and a note when the run is not finished:
    ``final_model.*`` of a finished run, else its newest intact checkpoint (None when it has
    none yet; held for the rest of ``held``)."""
    if finished_info(run) is not None:
        weights = verified_weights(run)
        return weights, _step_of(weights, run), ""
    final = next((run / name for name in FINAL_MODELS if (run / name).is_file()), None)
    checkpoint = newest_intact_checkpoint(run, held)
    if checkpoint is None:
        return final, None, ""
    config = json.loads((run / "config.json").read_text())
    total = config.get("max_train_steps", "?") or f"a budget of {config.get('max_train_time')}"
    state = "unfinished" if final is None else f"continued past its {final.name}"
    step = int(CHECKPOINT_NAME.match(checkpoint.name).group(1))
    note = f"{run.name} is {state}: using checkpoints/{checkpoint.name} (step {step} of {total})"
    return checkpoint / CHECKPOINT_WEIGHTS, step, note


def run_weights(path: str | Path, which: str | None = None, held: ExitStack | None = None) -> RunWeights:
    """The weights the tools take for ``path`` and the line that says which. A run folder
    gives its best validation (``best_model/``) unless ``which`` is ``FINAL`` or it has not
    validated; else its final weights, which for a run that is not finished (stopped, or a
    finished run being extended) are its newest intact checkpoint's. Anything else is
    ``verified_weights``, described by its run when it comes from one; ``which`` is for
    run folders only. With ``held``, the checkpoint or ``best_model`` folder chosen is held
    until ``held`` closes: load the weights before (``common.folder_locks``)."""
    run = Path(path)
    if not (run.is_dir() and (run / "config.json").is_file()):
        if which is not None:
            raise UserError(f"--weights {which} chooses among a run folder's weights; {path} is not a run folder")
        return weights_in_run(verified_weights(run, held))
    best = best_model_weights(run, held) if which != FINAL else None
    if best is not None:
        step, validations = _step_of(best, run), len(validation_history(run))
        line = (
            f"{run.name}: its best validation, {BEST_MODEL}/ at step {step} ({_score(run, step)}, the best of "
            f"{validations} validations{'' if finished_info(run) else '; the run has not finished'})"
        )
        return RunWeights(best, step, line, "--weights final for its latest weights")
    final, final_step, unfinished = _final_weights(run, held)
    if final is None:  # nothing to take: the error names what was looked for
        return RunWeights(verified_weights(run))
    line = unfinished or f"{run.name}: its final weights, {final.name} at step {final_step}"
    line += f" ({_score(run, final_step)})"
    if (run / BEST_MODEL / CHECKPOINT_WEIGHTS).is_file():
        return RunWeights(final, final_step, line, "--weights best (the default) for its best validation")
    return RunWeights(final, final_step, f"{line}; it did not validate, so there is no best model")


def weights_in_run(weights: Path) -> RunWeights:
    """``weights`` with their step and a line naming them in their run, when they come from one."""
    run = run_folder_of(weights)
    if run is None:
        return RunWeights(weights)
    step = _step_of(weights, run)
    at = f"step {step} ({_score(run, step)})" if step is not None else "step not recorded"
    return RunWeights(weights, step, f"{weights.relative_to(run)} of run {run.name}: {at}")


def run_folder_of(weights: Path) -> Path | None:
    """The training run that wrote ``weights`` (``models.weights.run_folder``)."""
    return run_folder(weights)


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
        (int(match.group(1)), p)
        for p in (run / "checkpoints").glob("checkpoint-*")
        if (match := CHECKPOINT_NAME.match(p.name)) and (p / CHECKPOINT_MANIFEST).is_file()
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
    atomic_write(run / FINISHED, json.dumps(info, indent=1))
