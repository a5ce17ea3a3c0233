"""Run directories, atomic checkpoints, and how ``--resume`` finds them.

A run directory is ``output_dir/<run_name>`` or, without a fixed name,
``output_dir/<config name>_<timestamp>``; its checkpoints are ``checkpoints/checkpoint-<step>``.

A checkpoint is written into ``checkpoints/.tmp-checkpoint-<step>`` by every rank, then the
main process writes ``checkpoint.json`` (the manifest: step, world size, every file and
its size) and renames the folder into place. A crash at any moment therefore leaves
either the previous checkpoints untouched or a complete new one: only folders with a
manifest whose files all exist count, so "latest" always names a complete checkpoint.

Nothing here unpickles: weights are safetensors, every other state goes through
``training.state_io`` (safetensors + JSON).
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors.torch import load_file, save_file

from models.atomic import TMP_PREFIX, atomic_write, fsync_directory, temporary_name
from training.config import TrainConfig, resolve_path, run_prefix
from training.errors import ConfigError
from training.state_io import load_tree, save_tree

logger = logging.getLogger(__name__)
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
CHECKPOINT_MANIFEST = "checkpoint.json"


class Stateful(Protocol):
    """Per-rank state a checkpoint holds besides the model (e.g. Seraena and its replay buffer)."""

    def training_state(self) -> dict[str, torch.Tensor]: ...

    def load_training_state(self, state: dict[str, torch.Tensor]) -> None: ...


# ----------------------------------------------------------------------------------------
# Finding runs and checkpoints
# ----------------------------------------------------------------------------------------


def checkpoint_step(path: Path) -> int:
    match = CHECKPOINT_RE.match(path.name)
    if not match:
        raise ConfigError(f"{path} is not a checkpoint folder (expected a name like checkpoint-1000)")
    return int(match.group(1))


def read_checkpoint_manifest(path: Path) -> dict:
    """The manifest of a complete checkpoint; ConfigError if it is missing or files are absent."""
    manifest_file = path / CHECKPOINT_MANIFEST
    if not manifest_file.is_file():
        raise ConfigError(f"checkpoint {path} is incomplete (no {CHECKPOINT_MANIFEST}): it was being written when the run "
                          "stopped, or comes from an older version; resume from an earlier checkpoint")
    manifest = json.loads(manifest_file.read_text())
    missing = [name for name, size in manifest["files"].items()
               if not (path / name).is_file() or (path / name).stat().st_size != size]
    if missing:
        raise ConfigError(f"checkpoint {path} is damaged: {len(missing)} file(s) missing or of the wrong size "
                          f"(e.g. {missing[:3]}); resume from an earlier checkpoint")
    return manifest


def is_complete(path: Path) -> bool:
    try:
        read_checkpoint_manifest(path)
    except ConfigError:
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
    root = resolve_path(config.output_dir)
    if config.run_name:
        return [root / config.run_name] if (root / config.run_name).is_dir() else []
    prefix = run_prefix(config) + "_"
    runs = [p for p in root.glob(prefix + "*") if p.is_dir()] if root.is_dir() else []
    return sorted(runs, key=lambda p: p.name, reverse=True)


def _latest(config: TrainConfig) -> tuple[Path, Path] | None:
    for run in _runs_of(config):
        checkpoints = list_checkpoints(run / "checkpoints")
        if checkpoints:
            return run, checkpoints[-1]
    return None


def resolve_resume(config: TrainConfig) -> tuple[Path | None, Path | None]:
    """(run directory, checkpoint) to continue; (None, None) for a fresh run.

    ``resume_from_checkpoint``: "latest" (newest complete checkpoint of this config's runs,
    an error if there is none), a checkpoint name (in this config's newest run) or a path
    (an error if it does not exist or is incomplete). ``auto_resume``: "latest" when there
    is a checkpoint, else a fresh run, so one command both starts and restarts a job.
    """
    spec = config.resume_from_checkpoint
    if not spec:
        if config.auto_resume and (found := _latest(config)):
            return found
        return None, None
    if spec == "latest":
        if found := _latest(config):
            return found
        raise ConfigError(f"--resume latest: no complete checkpoint in any {run_prefix(config)}* run under "
                          f"{resolve_path(config.output_dir)}; start without --resume or give a checkpoint path")
    path = resolve_path(spec)
    if "/" not in spec and not path.exists():  # a bare name: look in this config's newest run
        runs = _runs_of(config)
        path = runs[0] / "checkpoints" / spec if runs else path
    if not path.is_dir():
        raise ConfigError(f"--resume {spec}: checkpoint {path} does not exist")
    checkpoint_step(path)
    read_checkpoint_manifest(path)
    return path.parent.parent, path


def new_run_dir(config: TrainConfig) -> Path:
    root = resolve_path(config.output_dir)
    if config.run_name:
        return root / config.run_name
    return root / f"{run_prefix(config)}_{datetime.datetime.now().strftime('%Y-%m-%d_%H-%M-%S')}"


# ----------------------------------------------------------------------------------------
# Atomic writing
# ----------------------------------------------------------------------------------------


def remove_partial_checkpoints(directory: Path) -> None:
    """Delete temporary folders left by a save that was interrupted (main process only)."""
    if directory.is_dir():
        for leftover in directory.glob(TMP_PREFIX + "*"):
            logger.warning("removing %s, left by a checkpoint save that did not finish", leftover)
            shutil.rmtree(leftover)


def write_atomically(accelerator: Accelerator, final: Path, write: Callable[[Path], None],
                     info: dict[str, Any], before_commit: Callable[[], None] = lambda: None) -> Path:
    """Every rank calls ``write(tmp)``; then the main process writes the manifest and
    renames ``tmp`` to ``final``. ``before_commit`` runs on every rank just before the
    manifest (the test hook for a crash during saving)."""
    tmp = temporary_name(final)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    write(tmp)
    accelerator.wait_for_everyone()
    before_commit()
    if accelerator.is_main_process:
        files = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        atomic_write(tmp / CHECKPOINT_MANIFEST, json.dumps({**info, "files": files}, indent=1))
        if final.exists():  # an incomplete leftover of the same name
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_directory(final.parent)
    accelerator.wait_for_everyone()
    return final


# ----------------------------------------------------------------------------------------
# What a checkpoint holds
# ----------------------------------------------------------------------------------------


@dataclass
class TrainingObjects:
    """Everything a checkpoint saves and restores, as prepared by Accelerate."""

    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    ema: Any | None
    generator: torch.Generator
    extras: dict[str, Stateful] = field(default_factory=dict)  # per-rank state, e.g. Seraena

    @property
    def deepspeed(self) -> bool:
        return self.accelerator.distributed_type == DistributedType.DEEPSPEED

    @property
    def module(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)


def rng_state(generator: torch.Generator) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "generator": generator.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, generator: torch.Generator) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    generator.set_state(state["generator"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


# DeepSpeed keeps its loss scaler as an object and a table of fragment addresses in the
# optimizer state; the scaler is saved as its plain attributes, the table (only used by
# universal checkpoints) is left out.
_DS_LOSS_SCALER, _DS_SLICE_MAPPINGS = "loss_scaler", "param_slice_mappings"
_PLAIN = (bool, int, float, str, type(None), torch.Tensor)


def _deepspeed_optimizer_state(zero_optimizer) -> dict:
    state = dict(zero_optimizer.state_dict())
    scaler = state.pop(_DS_LOSS_SCALER, None)
    state.pop(_DS_SLICE_MAPPINGS, None)
    state["loss_scaler_attributes"] = {k: v for k, v in vars(scaler).items() if isinstance(v, _PLAIN)} if scaler else {}
    return state


def _load_deepspeed_optimizer_state(zero_optimizer, state: dict, rank: int, world_size: int) -> None:
    scaler_attributes = state.pop("loss_scaler_attributes")
    per_rank = [None] * world_size
    per_rank[rank] = state
    zero_optimizer.load_state_dict(per_rank, load_optimizer_states=True, load_from_fp32_weights=True)
    for name, value in scaler_attributes.items():
        setattr(zero_optimizer.loss_scaler, name, value)


def write_training_state(objects: TrainingObjects, directory: Path, trainer_state: dict) -> None:
    """This rank's part of a checkpoint (call on every rank)."""
    acc, rank = objects.accelerator, objects.accelerator.process_index
    save_tree(directory / f"rng_rank{rank}", rng_state(objects.generator))
    for name, extra in objects.extras.items():
        save_file(extra.training_state(), str(directory / f"{name}_rank{rank}.safetensors"))
    if objects.deepspeed:  # ZeRO partitions the optimizer: each rank saves its own shard
        save_tree(directory / f"optimizer_rank{rank}", _deepspeed_optimizer_state(objects.model.optimizer))
    if not acc.is_main_process:
        return
    module_state = {k: v.detach().contiguous() for k, v in objects.module.state_dict().items()}
    save_file(module_state, str(directory / "model.safetensors"))
    if not objects.deepspeed:
        save_tree(directory / "optimizer", objects.optimizer.state_dict())
    save_tree(directory / "scheduler", objects.scheduler.state_dict())
    if acc.scaler is not None:
        save_tree(directory / "grad_scaler", acc.scaler.state_dict())
    if objects.ema is not None:
        save_tree(directory / "ema", objects.ema.state_dict())
    (directory / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))


def read_trainer_state(path: Path) -> dict:
    return json.loads((path / "trainer_state.json").read_text())


def load_training_state(objects: TrainingObjects, path: Path) -> dict:
    """Restore everything ``write_training_state`` saved; returns the trainer state."""
    acc, rank = objects.accelerator, objects.accelerator.process_index
    manifest = read_checkpoint_manifest(path)
    if manifest["world_size"] != acc.num_processes:
        raise ConfigError(f"{path} was saved by {manifest['world_size']} process(es) but this run has "
                          f"{acc.num_processes}: resume with the same number of GPUs/processes (the optimizer "
                          "state, random streams and data shards are per process)")
    if manifest["distributed_type"] != str(acc.distributed_type):
        raise ConfigError(f"{path} was saved under {manifest['distributed_type']} but this run uses "
                          f"{acc.distributed_type}: resume with the same launcher (DeepSpeed or not)")
    # everything is read to the CPU; load_state_dict copies it into the live tensors on their device
    objects.module.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
    if objects.deepspeed:
        _load_deepspeed_optimizer_state(objects.model.optimizer, load_tree(path / f"optimizer_rank{rank}"),
                                        rank, acc.num_processes)
    else:
        objects.optimizer.load_state_dict(load_tree(path / "optimizer"))
    objects.scheduler.load_state_dict(load_tree(path / "scheduler"))
    if acc.scaler is not None:
        acc.scaler.load_state_dict(load_tree(path / "grad_scaler"))
    if objects.ema is not None:
        objects.ema.load_state_dict(load_tree(path / "ema"))
        objects.ema.to(acc.device)
    for name, extra in objects.extras.items():
        extra.load_training_state(load_file(str(path / f"{name}_rank{rank}.safetensors")))
    set_rng_state(load_tree(path / f"rng_rank{rank}"), objects.generator)
    return read_trainer_state(path)


def save_checkpoint(objects: TrainingObjects, directory: Path, step: int, keep: int, trainer_state: dict,
                    export: Callable[[Path], None], before_commit: Callable[[], None] = lambda: None) -> Path:
    """Atomically write ``checkpoint-<step>`` (full training state, plus ``export(tmp)`` of
    the fp32 weights inference loads, run on every rank), then keep the newest ``keep``.

    A complete checkpoint of the same step is kept as it is: it holds the same weights,
    and a run resumed from it replays any steps skipped since (deterministically)."""
    acc = objects.accelerator
    final = directory / f"checkpoint-{step}"
    if is_complete(final):
        return final

    def write(tmp: Path) -> None:
        write_training_state(objects, tmp, trainer_state)
        export(tmp)

    info = {"step": step, "world_size": acc.num_processes, "distributed_type": str(acc.distributed_type)}
    write_atomically(acc, final, write, info, before_commit)
    if acc.is_main_process:
        for old in list_checkpoints(directory)[:-keep]:
            shutil.rmtree(old)
        logger.info("saved checkpoint %s", final)
    acc.wait_for_everyone()
    return final
