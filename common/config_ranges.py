"""Every numeric config key's range, in one table (``RANGES``): ``training.preflight.check``
asks ``range_problems`` first, as the components' own rules (which relate keys to each
other, the variant and the data) compute with the values; ``inference.py`` takes its flags'
ranges from the keys they stand for."""

from __future__ import annotations

from dataclasses import dataclass

from taehv_train.common.config import TrainConfig


@dataclass(frozen=True)
class Range:
    """The values a numeric key may take: ``low`` to ``high``, both included unless ``open_low``
    or ``open_high``; None: no bound on that side."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False

    def holds(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.open_low else value >= self.low)
        return above and (self.high is None or (value < self.high if self.open_high else value <= self.high))

    def describe(self) -> str:
        """``">= 1"``, ``"> 0"``, ``"in [0, 4294967295]"``, ``"in (0, 1)"``."""
        low, high = (bound if not isinstance(bound, float) else f"{bound:g}" for bound in (self.low, self.high))
        if self.high is None:
            return "any finite number" if self.low is None else f"{'>' if self.open_low else '>='} {low}"
        return f"in {'(' if self.open_low else '['}{low}, {high}{')' if self.open_high else ']'}"

    def problem(self, name: str, value: float) -> str | None:
        """``"name=value must be in [low, high]"`` when ``value`` is out of range, else None."""
        return None if self.holds(value) else f"{name}={value!r} must be {self.describe()}"


COUNT = 2**31 - 1  # the bound of counts without a smaller sane one: what torch and numpy take as an int32
SIZE = Range(1, 16384)  # pixels of a side
WEIGHT = Range(0)  # loss weights and other non-negative factors
RATE = Range(0, 1, open_low=True)  # learning rates
# Every numeric key's range: ``range_problems`` checks them all before the components' own
# rules (which relate keys to each other, the variant and the data) compute with the values.
RANGES: dict[str, Range] = {
    "seed": Range(0, 2**32 - 1),  # what numpy's and Accelerate's seeding take
    "n_frames": Range(1, 1024),
    "height": SIZE,
    "width": SIZE,
    "val_height": Range(0, SIZE.high),
    "val_width": Range(0, SIZE.high),
    "stride_min": Range(1, 1000),
    "stride_max": Range(1, 1000),
    "crop_scale_min": Range(0, 1, open_low=True),
    "crop_scale_max": Range(0, 1, open_low=True),
    "max_failure_fraction": Range(0, 1),
    "dataloader_num_workers": Range(0, 256),
    "prefetch_factor": Range(1, 64),
    "shard_shuffle_buffer": Range(1, COUNT),
    "shard_read_attempts": Range(1, 100),
    "shard_retry_wait_s": Range(0, 3600),
    "prefetch_batches": Range(1, 64),  # and, with the frame caches, within RAM: training.loop.memory
    "batch_timeout": Range(0),
    "frame_cache_mb": Range(0, COUNT),  # within RAM: training.loop.memory
    "decoder_bias_init": Range(),
    "latent_cache_epochs": Range(1, 10_000),
    "seraena_loss_weight": WEIGHT,
    "n_seraena_frames": Range(1, 1024),
    "seraena_buffer_size": Range(1, COUNT),
    "seraena_learning_rate": RATE,
    "encoder_loss_weight": WEIGHT,
    "decoder_loss_weight": WEIGHT,
    "reconstruction_loss_weight": WEIGHT,
    "lpips_loss_weight": WEIGHT,
    "train_batch_size": Range(1, 4096),
    "gradient_accumulation_steps": Range(1, 65536),
    "max_train_steps": Range(0, COUNT),
    # more validations than this would leave a budget run little time to train
    "validations_per_budget": Range(0, 1000),
    "learning_rate": RATE,
    "adam_beta1": Range(0, 1, open_high=True),
    "adam_beta2": Range(0, 1, open_high=True),
    "weight_decay": WEIGHT,
    "max_grad_norm": WEIGHT,
    "lr_warmup_steps": Range(0, COUNT),
    "ema_decay": Range(0, 1, open_low=True, open_high=True),
    "log_every": Range(1, COUNT),
    "validation_every": Range(1, COUNT),
    "num_validation_samples": Range(0, COUNT),
    "validation_batch_size": Range(1, 4096),
    "image_log_every": Range(0, COUNT),
    "checkpointing_steps": Range(1, COUNT),
    "checkpoints_total_limit": Range(1, COUNT),
    "early_stopping_patience": Range(0, COUNT),
    "early_stopping_min_delta": WEIGHT,
    "max_consecutive_skipped_steps": Range(1, COUNT),
    "profile_steps": Range(0, COUNT),
}


def range_problems(config: TrainConfig) -> list[str]:
    """Each numeric key whose value lies outside its ``RANGES`` entry."""
    return [problem for name, bounds in RANGES.items() if (problem := bounds.problem(name, getattr(config, name)))]
