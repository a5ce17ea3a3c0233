"""Run directories, atomic checkpoints, and how ``--resume`` finds them.

A run directory is ``output_dir/<run_name>`` or, without a fixed name,
``output_dir/<config name>_<timestamp>``; its checkpoints are ``checkpoints/checkpoint-<step>``.

``save_checkpoint`` is the whole save, in order: every rank writes its part into
``checkpoints/.tmp-checkpoint-<step>``, then the main process writes ``checkpoint.json``
(the manifest: step, world size, every file with its size and CRC-32) and renames the
folder into place (the steps are ``training.state.atomic_folders``'). A crash at any
moment therefore leaves either the previous checkpoints untouched or a complete new one:
only folders with a manifest whose files all exist with their sizes count. Before a resume
the checksums are verified too, so a file damaged in place (same size) is caught before it
is trained on, and "latest" names the newest checkpoint that is complete and intact.

Nothing here unpickles: weights are safetensors, every other state goes through
``training.state.serialisation`` (safetensors + JSON).
"""

from __future__ import annotations

import datetime
import json
import logging
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors.torch import load_file, save_file

from taehv_train.base.atomic import TMP_PREFIX
from taehv_train.base.errors import UserError
from taehv_train.common.config import (
    TrainConfig,
    changed_from_file,
    config_file_label,
    resolve_path,
    run_prefix,
    same_config_file,
)
from taehv_train.common.folder_locks import remove_unless_read
from taehv_train.common.run_files import (
    CHECKPOINT_MANIFEST,
    DamagedCheckpointError,
    finished_info,
    newest_intact,
    read_checkpoint_manifest,
)
from taehv_train.training.state.atomic_folders import (
    abandon,
    checksum_files,
    failed_ranks,
    make_temporary_folder,
    ran_out_of_space,
    rename_into_place,
    write_manifest,
)
from taehv_train.training.state.serialisation import load_tree, save_tree, tensor_bytes
from taehv_train.training.state.trained_weights import export_weights

logger = logging.getLogger(__name__)
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


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


def remove_partial_checkpoints(directory: Path) -> None:
    """Delete temporary folders left by a save that was interrupted (main process only)."""
    if directory.is_dir():
        for leftover in directory.glob(TMP_PREFIX + "*"):
            logger.warning("removing %s, left by a checkpoint save that did not finish", leftover)
            shutil.rmtree(leftover)


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
    frozen: dict[str, torch.Tensor] = field(default_factory=dict)  # fp32 weights that do not train (a frozen encoder)

    @property
    def deepspeed(self) -> bool:
        return self.accelerator.distributed_type == DistributedType.DEEPSPEED

    @property
    def module(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)


def rng_state(generator: torch.Generator) -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
    }
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


def training_state_bytes(objects: TrainingObjects) -> int:
    """About how many bytes this rank's part of a checkpoint takes (its tensors, the
    exported fp32 weights included)."""
    total = sum(tensor_bytes(extra.training_state()) for extra in objects.extras.values())
    if objects.deepspeed:
        total += tensor_bytes(objects.model.optimizer.state_dict())
    if not objects.accelerator.is_main_process:
        return total
    module_state = objects.module.state_dict()
    total += tensor_bytes(module_state) + 4 * sum(v.numel() for v in module_state.values())  # + weights.safetensors
    if not objects.deepspeed:
        total += tensor_bytes(objects.optimizer.state_dict())
    return total + (tensor_bytes(objects.ema.state_dict()) if objects.ema is not None else 0)


def read_trainer_state(path: Path) -> dict:
    return json.loads((path / "trainer_state.json").read_text())


def load_training_state(objects: TrainingObjects, path: Path) -> dict:
    """Restore everything ``write_training_state`` saved; returns the trainer state."""
    acc, rank = objects.accelerator, objects.accelerator.process_index
    manifest = read_checkpoint_manifest(path)
    if manifest["world_size"] != acc.num_processes:
        raise UserError(
            f"{path} was saved by {manifest['world_size']} process(es) but this run has "
            f"{acc.num_processes}: resume with the same number of GPUs/processes (the optimizer "
            "state, random streams and data shards are per process)"
        )
    if manifest["distributed_type"] != str(acc.distributed_type):
        raise UserError(
            f"{path} was saved under {manifest['distributed_type']} but this run uses "
            f"{acc.distributed_type}: resume with the same launcher (DeepSpeed or not)"
        )
    # everything is read to the CPU; load_state_dict copies it into the live tensors on their device
    objects.module.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
    if objects.deepspeed:
        _load_deepspeed_optimizer_state(
            objects.model.optimizer, load_tree(path / f"optimizer_rank{rank}"), rank, acc.num_processes
        )
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


# ----------------------------------------------------------------------------------------
# Saving a checkpoint
# ----------------------------------------------------------------------------------------


class SaveFaults(Protocol):
    """Deliberate failures of a checkpoint save (``training.loop.resilience.FaultPlan``)."""

    def maybe_fill_disk(self, step: int, rank: int) -> None: ...

    def maybe_crash_in_save(self, step: int, rank: int) -> None: ...


def rotate_checkpoints(directory: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints in ``directory``; one a tool is reading
    (``common.folder_locks``) stays until a later rotation."""
    for old in list_checkpoints(directory)[:-keep]:
        if not remove_unless_read(old):
            logger.info("kept %s for now: a tool is reading it", old.name)


def save_checkpoint(
    objects: TrainingObjects, directory: Path, step: int, keep: int, trainer_state: dict, faults: SaveFaults
) -> Path:
    """Atomically write ``directory/checkpoint-<step>``: the full training state and the fp32
    weights inference loads, ``weights.safetensors``; then keep the newest ``keep``. Every
    rank calls it. ``faults`` may make the save fail as a full disk does once the training
    state is written, or kill the process before the manifest.

    An intact checkpoint of the same step is kept as it is: it holds the same weights,
    and a run resumed from it replays any steps skipped since (deterministically). A
    damaged one is replaced."""
    acc, rank = objects.accelerator, objects.accelerator.process_index
    final = directory / f"checkpoint-{step}"
    if is_complete(final) and newest_intact([final]):
        return final
    tmp = make_temporary_folder(acc, final)  # .tmp-checkpoint-<step>

    # every rank writes its part; a failure is held until all ranks know of it
    failure = None
    try:
        # this rank's RNG streams, extras and ZeRO shard; on the main process the module,
        # optimizer (without DeepSpeed), scheduler, grad scaler, EMA and trainer_state.json
        write_training_state(objects, tmp, trainer_state)
        faults.maybe_fill_disk(step, rank)
        # every rank gathers the fp32 weights (ZeRO shards them); the main process writes them
        export_weights(acc, objects.model, objects.ema, tmp, "weights", (".safetensors",), objects.frozen)
    except Exception as error:  # shared with the other ranks below, then raised
        failure = error
    if failed := failed_ranks(acc, failure):  # every rank stops; a full disk says the room needed
        abandon(acc, final, tmp, failure, failed, training_state_bytes(objects) if ran_out_of_space(failed) else 0)

    # the ranks checksum the files; the main process writes the manifest last and renames
    # the folder into place, so a crash before the rename leaves only the .tmp- folder
    start = time.perf_counter()
    checksums = checksum_files(acc, tmp)
    seconds = time.perf_counter() - start
    faults.maybe_crash_in_save(step, rank)
    if acc.is_main_process:
        info = {"step": step, "world_size": acc.num_processes, "distributed_type": str(acc.distributed_type)}
        write_manifest(tmp, info, checksums, seconds)
        rename_into_place(tmp, final)
    acc.wait_for_everyone()

    if acc.is_main_process:
        rotate_checkpoints(directory, keep)
        manifest = read_checkpoint_manifest(final)
        logger.info(
            "saved checkpoint %s (%.0f MB; checksums took %.2f s)",
            final,
            sum(entry["size"] for entry in manifest["files"].values()) / 2**20,
            manifest["checksum_seconds"],
        )
    acc.wait_for_everyone()
    return final
