"""Which config a start trains with: a resume continues from its run's own saved config.

A fresh start takes the preset (or config file) and the ``--key=value`` overrides. A resume
takes the config the checkpoint saved (``trainer_state.json``), so a key not repeated on the
resume line keeps the run's value and the preset is never re-read over it (a preset that
changed, or one that picks its precision by the machine, cannot change a run); the
overrides typed on the resume line apply on top and are listed ("changed on resume").
With the same overrides, or none, the config is the saved one, so the resume stays
bit-identical. A finished run is resumed only when named, and only to extend it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from taehv_train.base.errors import UserError
from taehv_train.common.config import (
    TrainConfig,
    apply_overrides,
    given_keys,
    resolve_paths,
    with_budget,
)
from taehv_train.common.missing_paths import missing_paths
from taehv_train.common.run_files import finished_info
from taehv_train.training.state.run_data import data_changes, data_record, validation_changed
from taehv_train.training.state.run_folders import checkpoint_step, read_trainer_state, resolve_resume

logger = logging.getLogger(__name__)

# how this start runs, never taken from the run: which checkpoint, whether its data may have changed,
# and faults injected by tests
START_KEYS = ("resume_from_checkpoint", "auto_resume", "allow_data_change", "fault_injection")
_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


@dataclass(frozen=True)
class Start:
    """What this start does: a fresh run (``checkpoint`` None), a resume, or nothing
    (``done``: a restarted job whose run already finished)."""

    config: TrainConfig
    run: Path | None = None
    checkpoint: Path | None = None
    step: int = 0  # the checkpoint's step
    horizon: int = 0  # the step the run ends at
    changes: tuple[str, ...] = ()  # "key old -> new" for each key the resume line changed, then the data's changes
    extending: bool = False  # a finished run trained further
    new_validation_set: bool = False  # the validation clips changed (allowed): the best-model comparison restarts
    done: bool = False


def config_for_resume(base: TrainConfig, given: list[str], saved: dict) -> tuple[TrainConfig, tuple[str, ...]]:
    """The run's ``saved`` config with ``given`` applied on top, and the changes. Keys the
    run predates take ``base``'s (the preset's) value; keys this version no longer knows are
    dropped (and listed); the ``START_KEYS`` are this start's. A ``--variant`` other than
    the run's is refused: a checkpoint holds the weights of one variant. A ``max_train_time``
    given without ``max_train_steps`` is the run's length, as at a fresh start."""
    known = {key: value for key, value in saved.items() if key in _FIELDS}
    start = {key: getattr(base, key) for key in START_KEYS}
    config = TrainConfig(**{**base.to_dict(), **known, **start})
    config = resolve_paths(with_budget(apply_overrides(config, given), given_keys(given)))
    if "variant" in given_keys(given) and "variant" in known and config.variant != known["variant"]:
        raise UserError(
            f"the run holds a {known['variant']} model but this resume asks for --variant={config.variant}: "
            f"resume with --variant={known['variant']} (or without --variant), or start a fresh run"
        )
    changes = [
        f"{key} {known[key]!r} -> {value!r}"
        for key, value in config.to_dict().items()
        if key in known and key not in START_KEYS and value != known[key]
    ]
    changes += [f"{key} dropped (unknown to this version)" for key in sorted(set(saved) - _FIELDS)]
    return config, tuple(changes)


def start_of(base: TrainConfig, given: list[str]) -> Start:
    """How this start goes, from the preset's config with the overrides (``base``) and the
    overrides as typed (``given``); nothing is created. A finished run is refused unless
    the resume line raises ``max_train_steps`` past its end (or, stopped early, changes
    something); a job restarted under its fixed run name (``auto_resume``) whose run
    finished has nothing to do."""
    run, checkpoint = resolve_resume(base)
    if checkpoint is None:
        return Start(base)
    state = read_trainer_state(checkpoint)
    saved = state.get("config", {})
    config, changes = config_for_resume(base, given, saved)
    step, planned = checkpoint_step(checkpoint), state.get("progress", {}).get("planned_steps")
    start = Start(config, run, checkpoint, step, planned or config.max_train_steps, changes)
    info = finished_info(run)
    if info is None:
        return with_data_checked(start, state.get("data"))
    raised = config.max_train_steps > info["step"]
    if (info["reason"] == "finished" and raised) or (info["reason"] == "early_stop" and changes):
        extended = dataclasses.replace(start, horizon=config.max_train_steps, extending=True)
        return with_data_checked(extended, state.get("data"))
    if not base.resume_from_checkpoint:  # auto_resume
        return dataclasses.replace(start, done=True)
    how = (
        f"finished at step {info['step']} ({run_length(info, saved)}): "
        f"give --max_train_steps above {info['step']}{spent_budget(saved)} to extend it"
        if info["reason"] == "finished"
        else f"stopped early at step {info['step']}: give the changes that train it further "
        "(e.g. --early_stopping_patience=0)"
    )
    raise UserError(f"{run} {how}, or start a new run (without --resume)")


def with_data_checked(start: Start, saved: dict | None) -> Start:
    """``start`` with the changes of its run's data (``training.state.run_data``) listed, and
    ``new_validation_set`` when the validation clips changed; a change is refused unless the
    resume line gives ``allow_data_change``. A run that recorded no data (from before the
    record) is not compared, nor data that is missing now (the pre-flight names it)."""
    if saved is None or missing_paths(start.config):
        return start
    now = data_record(start.config)
    changed = data_changes(saved, now)
    if not changed:
        return start
    new_validation_set = validation_changed(saved, now)
    if not start.config.allow_data_change:
        scores = ", and score its best model on another validation set" if new_validation_set else ""
        raise UserError(
            f"the data of {start.run} changed since it started ({'; '.join(changed)}): this resume would train on "
            f"other clips{scores}. Put the data back as it was, resume with --allow_data_change=true to go on with "
            "the clips as they are now, or start a new run (without --resume)"
        )
    changes = (*start.changes, *(f"data: {change}" for change in changed))
    if new_validation_set:
        changes += ("data: the best-model comparison restarts (scores of other validation sets are not compared)",)
    return dataclasses.replace(start, changes=changes, new_validation_set=new_validation_set)


def run_length(info: dict, saved: dict) -> str:
    """What ended a finished run: its step limit, or its time budget (the run's own, from its
    ``saved`` config, not one typed on the resume line)."""
    steps = info.get("max_train_steps", saved.get("max_train_steps"))
    return f"max_train_steps={steps}" if steps else f"max_train_time={saved.get('max_train_time')}"


def spent_budget(saved: dict) -> str:
    """For a run with a time budget (in its ``saved`` config): that it is spent, and how to lift it."""
    if not saved.get("max_train_time"):
        return ""
    return f" and --max_train_time= (or more than its spent {saved['max_train_time']})"


def describe_start(start: Start) -> str:
    """One line for a resume: the checkpoint, its step of the run's end, the run, and what
    the resume line changed; empty for a fresh start."""
    if start.checkpoint is None:
        return ""
    if start.done:
        return f"nothing to do: {start.run} finished at step {start.step} (raise --max_train_steps to extend it)"
    changed = ", ".join(start.changes) or "nothing"
    run = f"the finished run {start.run}, extending it" if start.extending else f"run {start.run}"
    of = f"of {start.horizon}" if start.horizon else "(its time budget has not planned its step count yet)"
    line = f"{start.checkpoint} at step {start.step} {of} ({run}); changed on resume: {changed}"
    return line + ("; final_model.* and export/ are replaced at its end" if start.extending else "")
