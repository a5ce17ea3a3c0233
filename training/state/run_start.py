"""The start of a run, agreed by every process: how it goes and where it writes.

Each is decided once on the main process and broadcast, so every rank trains the same
config from the same checkpoint into the same run directory, and a refusal reaches every
rank (none waits for the others).
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

import torch
from accelerate import PartialState

from taehv_train.base.errors import UserError
from taehv_train.common.config import TrainConfig
from taehv_train.training.state.run_config import Start, start_of
from taehv_train.training.state.run_folders import new_run_dir
from taehv_train.training.state.run_lock import lock_run_dir


def decide_start(state: PartialState, base: TrainConfig, given: list[str]) -> Start:
    """How this start goes (``training.state.run_config.start_of``: a fresh run, or a resume
    with the run's own config), decided once on the main process and shared, so every rank
    trains the same config from the same checkpoint; a refusal reaches every rank, so none
    waits for the others. Nothing is created."""
    decision: list[Start | str | None] = [None]
    if state.is_main_process:
        try:
            decision[0] = start_of(base, given)
        except UserError as err:
            decision[0] = str(err)
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(decision, src=0)
    if isinstance(decision[0], str):
        raise UserError(decision[0])
    return decision[0]


def claim_run_dir(state: PartialState, start: Start) -> tuple[Path, IO[str] | None]:
    """(run directory, its lock): the resumed run's own, else a new one, made and locked on
    the main process and shared, so every rank writes to the same place. The main process
    holds the lock; a refusal (another run holds it, a folder that cannot be made) reaches
    every rank."""
    config = start.config
    decision, lock = [None], None
    if state.is_main_process:
        try:
            run_dir = start.run or new_run_dir(config)
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = lock_run_dir(run_dir)
            decision[0] = (str(run_dir),)
        except UserError as err:
            decision[0] = str(err)
        except OSError as err:  # output_dir on a read-only or missing file system
            decision[0] = (
                f"cannot write the run directory under {config.output_dir}: {err.strerror or err}; "
                "choose an output_dir you can write"
            )
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(decision, src=0)
    if isinstance(decision[0], str):
        raise UserError(decision[0])
    return Path(decision[0][0]), lock
