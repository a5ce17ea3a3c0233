"""Which of a run's clip sets an evaluated clip comes from: the held-out (validation) set,
the training set, or neither. A model scores better on clips it was trained on, so every
sample says which it is, and the evaluation takes held-out clips first."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from taehv_train.common.clip_table import ClipTable
from taehv_train.common.config import TrainConfig

logger = logging.getLogger(__name__)

HELD_OUT, TRAINING, NEITHER, UNKNOWN = "held-out", "training", "neither", "unknown"
# the order clips are evaluated in: the model never saw the first ones, it trained on the last
PREFERENCE = (HELD_OUT, NEITHER, UNKNOWN, TRAINING)


def _paths(data_root: str, annotation: str, what: str) -> frozenset[str] | None:
    """The real paths of the clips a dataset of ``data_root`` and ``annotation`` reads
    (training's rule, ``ClipTable.from_source``); None when they cannot be listed (then
    whether a clip outside the other set is in this one cannot be told)."""
    if not (annotation or data_root):
        return frozenset()
    try:
        table, _ = ClipTable.from_source(data_root or None, annotation or None)
    except (OSError, ValueError, KeyError) as err:  # files gone or damaged
        logger.warning("the run's %s clips cannot be listed (%s): samples outside the other set are unknown", what, err)
        return None
    return frozenset(os.path.realpath(table.path(i)) for i in range(len(table)))


@dataclass(frozen=True)
class RunSets:
    """The clips a run held out and trained on (None: not known)."""

    held_out: frozenset[str] | None
    training: frozenset[str] | None

    @classmethod
    def of(cls, config: TrainConfig | None) -> RunSets:
        """The sets of the run ``config`` describes; both unknown without a config."""
        if config is None:
            return cls(None, None)
        held_out = frozenset()  # no validation set: nothing held out
        if config.val_annotation_file:
            held_out = _paths(config.data_root, config.val_annotation_file, "held-out")
        return cls(held_out, _paths(config.data_root, config.annotation_file, "training"))

    def split(self, path: str | Path) -> str:
        """HELD_OUT, TRAINING, NEITHER, or UNKNOWN where a set that could hold it is not known."""
        real = os.path.realpath(path)
        if self.held_out is not None and real in self.held_out:
            return HELD_OUT
        if self.training is not None and real in self.training:
            return TRAINING
        return NEITHER if self.held_out is not None and self.training is not None else UNKNOWN

    def preferred(self, order: list[int], path_of: Callable[[int], str]) -> list[int]:
        """``order`` with held-out clips first and training clips last, each group in its order."""
        return sorted(order, key=lambda i: PREFERENCE.index(self.split(path_of(i))))
