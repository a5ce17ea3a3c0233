"""Atomic checkpoints: what one holds, saving it and loading it back (which checkpoint a
run continues is ``training.state.run_folders``').

``save_checkpoint`` is the whole save, in order: every rank writes its part into
``checkpoints/.tmp-checkpoint-<step>``, then the main process writes ``checkpoint.json``
(the manifest: step, world size, every file with its size and CRC-32) and renames the
folder into place (the steps are ``training.state.atomic_folders``'). A crash at any
moment therefore leaves either the previous checkpoints untouched or a complete new one.

Nothing here unpickles: weights are safetensors, every other state goes through
``training.state.serialisation`` (safetensors + JSON).
"""

from __future__ import annotations

import json
import logging
import random
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
from taehv_train.common.folder_locks import remove_unless_read
from taehv_train.common.run_files import newest_intact, read_checkpoint_manifest
from taehv_train.training.loop.library_seams import load_zero_optimizer_state, unwrapped_model, zero_optimizer_state
from taehv_train.training.state.atomic_folders import (
    abandon,
    checksum_files,
    failed_ranks,
    make_temporary_folder,
    ran_out_of_space,
    rename_into_place,
    write_manifest,
)
from taehv_train.training.state.run_folders import is_complete, list_checkpoints, read_trainer_state
from taehv_train.training.state.serialisation import load_tree, save_tree, tensor_bytes
from taehv_train.training.state.trained_weights import export_weights

logger = logging.getLogger(__name__)


class Stateful(Protocol):
    """Per-rank state a checkpoint holds besides the model (e.g. Seraena and its replay buffer)."""

    def training_state(self) -> dict[str, torch.Tensor]: ...

    def load_training_state(self, state: dict[str, torch.Tensor]) -> None: ...


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
        return unwrapped_model(self.accelerator, self.model)


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


def write_training_state(objects: TrainingObjects, directory: Path, trainer_state: dict) -> None:
    """This rank's part of a checkpoint (call on every rank)."""
    acc, rank = objects.accelerator, objects.accelerator.process_index
    save_tree(directory / f"rng_rank{rank}", rng_state(objects.generator))
    for name, extra in objects.extras.items():
        save_file(extra.training_state(), str(directory / f"{name}_rank{rank}.safetensors"))
    if objects.deepspeed:  # ZeRO partitions the optimizer: each rank saves its own shard
        save_tree(directory / f"optimizer_rank{rank}", zero_optimizer_state(objects.model.optimizer))
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
        load_zero_optimizer_state(
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


def remove_partial_checkpoints(directory: Path) -> None:
    """Delete temporary folders left by a save that was interrupted (main process only)."""
    if directory.is_dir():
        for leftover in directory.glob(TMP_PREFIX + "*"):
            logger.warning("removing %s, left by a checkpoint save that did not finish", leftover)
            shutil.rmtree(leftover)


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
