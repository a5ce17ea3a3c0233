"""Where runs and checkpoints live, and how ``--resume`` finds them.

A run directory is ``output_dir/<run_name>`` or, without a fixed name,
``output_dir/<config name>_<timestamp>``; its checkpoints are ``checkpoints/checkpoint-<step>``.
``--resume latest`` continues the newest run of the same config (or the named run) in its
own directory; a checkpoint that does not exist is an error, never a silent fresh start.
"""
from __future__ import annotations

import datetime
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from accelerate import Accelerator

from training.config import ConfigError, TrainConfig, resolve_path, run_prefix

logger = logging.getLogger(__name__)
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and CHECKPOINT_RE.match(p.name)]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    match = CHECKPOINT_RE.match(path.name)
    if not match:
        raise ConfigError(f"{path} is not a checkpoint folder (expected a name like checkpoint-1000)")
    return int(match.group(1))


def _runs_of(config: TrainConfig) -> list[Path]:
    """This config's run directories, newest first."""
    root = resolve_path(config.output_dir)
    if config.run_name:
        return [root / config.run_name] if (root / config.run_name).is_dir() else []
    prefix = run_prefix(config) + "_"
    runs = [p for p in root.glob(prefix + "*") if p.is_dir()] if root.is_dir() else []
    return sorted(runs, key=lambda p: p.name, reverse=True)


def resolve_resume(config: TrainConfig) -> tuple[Path | None, Path | None]:
    """(run directory, checkpoint) for ``resume_from_checkpoint``; (None, None) for a fresh run."""
    spec = config.resume_from_checkpoint
    if not spec:
        return None, None
    if spec == "latest":
        for run in _runs_of(config):
            checkpoints = list_checkpoints(run / "checkpoints")
            if checkpoints:
                return run, checkpoints[-1]
        raise ConfigError(f"--resume latest: no checkpoint in any {run_prefix(config)}* run under "
                          f"{resolve_path(config.output_dir)}; start without --resume or give a checkpoint path")
    path = resolve_path(spec)
    if "/" not in spec and not path.exists():  # a bare name: look in this config's newest run
        runs = _runs_of(config)
        path = runs[0] / "checkpoints" / spec if runs else path
    if not path.is_dir():
        raise ConfigError(f"--resume {spec}: checkpoint {path} does not exist")
    checkpoint_step(path)
    return path.parent.parent, path


def new_run_dir(config: TrainConfig) -> Path:
    root = resolve_path(config.output_dir)
    if config.run_name:
        return root / config.run_name
    return root / f"{run_prefix(config)}_{datetime.datetime.now().strftime('%Y-%m-%d_%H-%M-%S')}"


def save_checkpoint(accelerator: Accelerator, directory: Path, step: int, keep: int,
                    export: Callable[[Path], None]) -> Path:
    """Full training state (all ranks take part) plus ``export(path)`` of fp32 weights
    (``weights.safetensors``, what inference loads), then drop all but the newest ``keep``."""
    path = directory / f"checkpoint-{step}"
    accelerator.save_state(str(path))
    if accelerator.is_main_process:
        export(path)
        for old in list_checkpoints(directory)[:-keep]:
            shutil.rmtree(old)
        logger.info("saved checkpoint %s", path)
    accelerator.wait_for_everyone()
    return path
