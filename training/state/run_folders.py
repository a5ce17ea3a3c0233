"""Run directories and the checkpoints in them: naming a new run, listing the complete
checkpoints, and which one ``--resume`` continues.

A run directory is ``output_dir/<run_name>`` or, without a fixed name,
``output_dir/<config name>_<timestamp>``; its checkpoints are ``checkpoints/checkpoint-<step>``.
Only folders with a manifest whose files all exist with their sizes count
(``training.state.checkpoints`` writes them); before a resume the checksums are verified
too, so a file damaged in place (same size) is caught before it is trained on, and "latest"
names the newest checkpoint that is complete and intact.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
from pathlib import Path

from taehv_train.base.errors import UserError
from taehv_train.common.config import (
    TrainConfig,
    changed_from_file,
    config_file_label,
    resolve_path,
    run_prefix,
    same_config_file,
)
from taehv_train.common.run_files import (
    CHECKPOINT_MANIFEST,
    DamagedCheckpointError,
    finished_info,
    newest_intact,
    read_checkpoint_manifest,
)

logger = logging.getLogger(__name__)
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_step(path: Path) -> int:
    match = CHECKPOINT_RE.match(path.name)
    if not match:
        raise UserError(f"{path} is not a checkpoint folder (expected a name like checkpoint-1000)")
    return int(match.group(1))


def is_complete(path: Path) -> bool:
    try:
        read_checkpoint_manifest(path)
    except DamagedCheckpointError:
        return False
    return True


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first (incomplete ones are skipped)."""
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        if p.is_dir() and CHECKPOINT_RE.match(p.name):
            if is_complete(p):
                found.append(p)
            else:
                logger.warning("ignoring incomplete checkpoint %s", p)
    return sorted(found, key=checkpoint_step)


def _runs_of(config: TrainConfig) -> list[Path]:
    """This config's run directories, newest first."""
    root = Path(config.output_dir)
    if config.run_name:
        return [root / config.run_name] if (root / config.run_name).is_dir() else []
    prefix = run_prefix(config) + "_"
    runs = [p for p in root.glob(prefix + "*") if p.is_dir()] if root.is_dir() else []
    return sorted(runs, key=lambda p: p.name, reverse=True)


def _latest(config: TrainConfig, finished_too: bool = False) -> tuple[Path, Path] | None:
    """The newest intact checkpoint of the newest of this config's runs that holds one; a
    finished run is passed over (``finished_too``: not), since continuing it would replace
    its final model: it is resumed by name or path, to extend it. None when there is none;
    a UserError when every run that holds one is finished."""
    passed = []
    for run in _runs_of(config):
        checkpoint = newest_intact(list_checkpoints(run / "checkpoints"))
        if checkpoint is None:
            continue
        if not finished_too and (info := finished_info(run)) is not None:
            logger.info("passing over %s: finished at step %s", run, info["step"])
            passed.append((run, checkpoint, info))
            continue
        return run, checkpoint
    if passed and config.resume_from_checkpoint:
        run, checkpoint, info = passed[0]
        raise UserError(
            f"--resume latest: every {run_prefix(config)} run under {Path(config.output_dir)} is finished "
            f"(newest: {run}, at step {info['step']}). To train it further: --resume {checkpoint} "
            f"--max_train_steps=<more than {info['step']}>; for a new run leave out --resume"
        )
    return None


def _checkpoint_named(config: TrainConfig, name: str) -> Path:
    """A bare checkpoint name: the newest of this config's runs that holds it (runs whose
    start failed, and so hold no checkpoints, are passed over)."""
    for run in _runs_of(config):
        if (run / "checkpoints" / name).is_dir():
            return run / "checkpoints" / name
    raise UserError(
        f"--resume {name}: no run of this config under {Path(config.output_dir)} holds "
        f"{name} (runs searched: {', '.join(p.name for p in _runs_of(config)) or 'none'})"
    )


def verify_intact(path: Path) -> None:
    """A damaged or incomplete checkpoint is an error that names the newest intact one before it."""
    try:
        read_checkpoint_manifest(path, verify_checksums=True)
    except DamagedCheckpointError as err:
        older = newest_intact([p for p in list_checkpoints(path.parent) if checkpoint_step(p) < checkpoint_step(path)])
        raise DamagedCheckpointError(
            f"{err}; " + (f"resume from {older.name}" if older else "no intact checkpoint before it: start a fresh run")
        ) from None


def read_trainer_state(path: Path) -> dict:
    return json.loads((path / "trainer_state.json").read_text())


def check_own_run(config: TrainConfig, run: Path, checkpoint: Path) -> None:
    """A resume continues the checkpoint's own run, in its folder, under the config that
    started it. Another preset or config file than the one the checkpoint records, or an
    ``output_dir``/``run_name`` set on the command line that names another folder, is
    refused before anything is written (``--key=value`` changes of other keys stay allowed)."""
    started_with = read_trainer_state(checkpoint).get("config", {}).get("config_file", "")
    conflicts = []
    if not same_config_file(started_with, config.config_file):
        conflicts.append(f"uses {config_file_label(config.config_file)}")
    given = changed_from_file(config, ("output_dir", "run_name"))
    elsewhere = [
        f"--{key}={getattr(config, key)}"
        for key, differs in (
            ("output_dir", Path(config.output_dir).resolve() != run.resolve().parent),
            ("run_name", config.run_name != run.name),
        )
        if key in given and differs
    ]
    if elsewhere:
        conflicts.append(f"gives {' '.join(elsewhere)}")
    if not conflicts:
        return
    origin = config_file_label(started_with) if started_with else "its own config"
    weights = checkpoint / "weights.safetensors"
    raise UserError(
        f"{checkpoint} belongs to the run {run}, started with {origin}, but this command {' and '.join(conflicts)}: "
        f"a resume continues its run in its own folder under the config that started it. Resume with {origin} "
        "(--key=value changes allowed) and no other --output_dir/--run_name, or start a new run from its "
        f"weights with --pretrained_model_path={weights if weights.is_file() else checkpoint}"
    )


WEIGHT_SUFFIXES = (".safetensors", ".pth")


def _checkpoint_near(path: Path) -> Path | None:
    """For a file given to ``--resume``: the checkpoint folder it sits in, else the newest
    checkpoint of the run folder it sits in (or of the run above: best_model/, export/)."""
    if CHECKPOINT_RE.match(path.parent.name) and (path.parent / CHECKPOINT_MANIFEST).is_file():
        return path.parent
    for run in (path.parent, path.parent.parent):
        if found := list_checkpoints(run / "checkpoints"):
            return found[-1]
    return None


def not_a_checkpoint(spec: str, path: Path) -> UserError:
    """``--resume`` given a file (a weight file, a manifest, a config): what it is and what
    to give instead."""
    near = _checkpoint_near(path)
    ways = []
    if path.suffix in WEIGHT_SUFFIXES:
        exported = near / "weights.safetensors" if near == path.parent else None
        weights = exported if exported is not None and exported.is_file() else path
        ways.append(f"start a new run from these weights with --pretrained_model_path={weights}")
    ways.append(
        f"continue its run with --resume {near}"
        if near is not None
        else "continue a run with --resume <run>/checkpoints/checkpoint-<step> (a checkpoint folder)"
    )
    what = "a weight file" if path.suffix in WEIGHT_SUFFIXES else "a file"
    return UserError(f"--resume {spec}: {path} is {what}, not a checkpoint folder: {', or '.join(ways)}")


def resolve_resume(config: TrainConfig) -> tuple[Path | None, Path | None]:
    """(run directory, checkpoint) to continue; (None, None) for a fresh run.

    ``resume_from_checkpoint``: "latest" (the newest complete and intact checkpoint of this
    config's runs, an error if there is none), a checkpoint name (in the newest of this
    config's runs that holds it) or a path (an error if it does not exist, is incomplete or
    damaged; a file, such as a weight file, is refused saying what to give instead).
    "latest" passes over finished runs. ``auto_resume``: "latest" when there is a checkpoint
    (under a fixed ``run_name``, finished or not), else a fresh run, so one command both
    starts and restarts a job. The run is continued in its own folder under the config that
    started it (``check_own_run``); which config it continues with is
    ``training.state.run_config``'s.
    """
    spec = config.resume_from_checkpoint
    found = None
    if spec == "latest" or (not spec and config.auto_resume):
        # a job restarted under a fixed run_name finds its own run, finished or not
        found = _latest(config, finished_too=not spec and bool(config.run_name))
        if found is None and spec:
            raise UserError(
                f"--resume latest: no complete checkpoint in any {run_prefix(config)}* run under "
                f"{Path(config.output_dir)}; start without --resume or give a checkpoint path"
            )
    elif spec:
        path = resolve_path(spec)
        if "/" not in spec and not path.exists():  # a bare name
            path = _checkpoint_named(config, spec)
        if path.is_file():
            raise not_a_checkpoint(spec, path)
        if not path.is_dir():
            raise UserError(f"--resume {spec}: checkpoint {path} does not exist")
        checkpoint_step(path)
        verify_intact(path)
        found = path.parent.parent, path
    if found is None:
        return None, None
    check_own_run(config, *found)
    return found


def new_run_dir(config: TrainConfig) -> Path:
    root = Path(config.output_dir)
    if config.run_name:
        return root / config.run_name
    return root / f"{run_prefix(config)}_{datetime.datetime.now().strftime('%Y-%m-%d_%H-%M-%S')}"
