"""Validation history, the best model and early stopping.

The tracker sees the gathered validation metrics, which are identical on every rank, but
the stop decision is still taken on rank 0 and broadcast by the loop, so no rank can
leave while another waits in a collective. Its state (history, best value, patience
counter) lives in every checkpoint, so a resumed run stops exactly where an uninterrupted
one would. Only the history is stored: the best value and the patience counter are
replayed from it, so they always agree with it (also when the metric is changed on resume).
A resume onto another validation set (``allow_data_change``) restarts the comparison:
validations up to ``since`` stay in the history but are not compared with later ones.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from taehv_train.base.atomic import atomic_write
from taehv_train.common.config import TrainConfig

logger = logging.getLogger(__name__)

# metric -> True when higher is better
METRIC_DIRECTIONS = {
    "val/psnr": True,
    "val/ssim": True,
    "val/psnr_from_reference_latents": True,
    "val/mse": False,
    "val/lpips": False,
    "val/preview_psnr": True,  # one latent decoded alone: what a sampler's live preview shows
    "val/preview_ssim": True,
    "val/preview_psnr_from_reference_latents": True,
}


def config_errors(config: TrainConfig) -> list[str]:
    """What is wrong with the best-model and early-stopping keys."""
    found = []
    if config.best_metric not in METRIC_DIRECTIONS:
        found.append(f"best_metric={config.best_metric!r}: expected one of {', '.join(METRIC_DIRECTIONS)}")
    if config.best_metric.endswith("_from_reference_latents") and not config.ref_vae_path:
        found.append(f"best_metric={config.best_metric} needs a reference VAE (ref_vae_path)")
    if config.early_stopping_patience and not (config.val_annotation_file and config.num_validation_samples):
        found.append(
            "early_stopping_patience > 0 needs validation: set val_annotation_file and num_validation_samples > 0"
        )
    return found


@dataclass
class BestTracker:
    metric: str = "val/psnr"
    patience: int = 0  # validations without improvement before stopping; 0: never stop early
    min_delta: float = 0.0
    best_value: float | None = None
    best_step: int | None = None
    bad_validations: int = 0
    history: list[dict] = field(default_factory=list)
    since: int = -1  # validations at this step or before scored other clips: not compared

    @property
    def higher_is_better(self) -> bool:
        return METRIC_DIRECTIONS[self.metric]

    def update(self, step: int, metrics: dict[str, float]) -> bool:
        """Record a validation; True when it is a new best."""
        self.history.append({"step": step, **metrics})
        return self._score(step, metrics)

    def _score(self, step: int, metrics: dict[str, float]) -> bool:
        if self.metric not in metrics:
            raise KeyError(f"best_metric {self.metric!r} was not computed by validation (got {sorted(metrics)})")
        value = metrics[self.metric]
        sign = 1.0 if self.higher_is_better else -1.0
        improved = math.isfinite(value) and (
            self.best_value is None or sign * (value - self.best_value) > self.min_delta
        )
        if improved:
            self.best_value, self.best_step, self.bad_validations = value, step, 0
        else:
            self.bad_validations += 1
        return improved

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.bad_validations >= self.patience

    @classmethod
    def replay(cls, history: list[dict], metric: str, patience: int, min_delta: float, since: int = -1) -> BestTracker:
        """The tracker a run with this history would have now (comparing the validations after ``since``)."""
        tracker = cls(metric=metric, patience=patience, min_delta=min_delta, history=list(history), since=since)
        for entry in history:
            if entry["step"] > since:
                tracker._score(entry["step"], {k: v for k, v in entry.items() if k != "step"})
        return tracker

    def write_history(self, run_dir: Path) -> None:
        atomic_write(run_dir / "validation_history.json", json.dumps(self.history, indent=1))
