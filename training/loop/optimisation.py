"""The optimisation keys and their rules: precision, schedule, optimizer settings, compile,
the time budget's durations; the learning-rate schedules themselves.

Kept apart from ``step.py`` (which builds the optimizer, scheduler and the EMA weights
with diffusers) so that the config check stays light: importing diffusers takes over a second.
"""

from __future__ import annotations

import math
import re

import torch

from taehv_train.common.config import TrainConfig
from taehv_train.training.loop.library_seams import compile_backends

MIXED_PRECISION = ("no", "fp16", "bf16")
LR_SCHEDULERS = ("constant", "constant_with_warmup", "cosine", "linear")


def config_errors(config: TrainConfig) -> list[str]:
    """What is wrong with the optimisation and model keys."""
    found = []
    if not (config.max_train_steps or config.max_train_time):
        found.append(
            "max_train_steps=0 (no step limit) needs a time budget: set max_train_time, or max_train_steps >= 1"
        )
    if config.mixed_precision not in MIXED_PRECISION:
        found.append(f"mixed_precision must be one of {MIXED_PRECISION}")
    if config.max_train_time and (seconds := duration_seconds(config.max_train_time)) is None:
        found.append(f"max_train_time={config.max_train_time!r} is not a duration: write e.g. 8h, 45m, 1h30m or 600s")
    elif config.max_train_time and seconds <= 0:
        found.append(
            f"max_train_time={config.max_train_time!r} is not positive: give a budget such as 8h, or leave it "
            "empty to train max_train_steps"
        )
    if config.lr_scheduler not in LR_SCHEDULERS:
        found.append(f"lr_scheduler must be one of {LR_SCHEDULERS}")
    if str(config.compile).lower() not in COMPILE_CHOICES:
        found.append(f"compile={config.compile!r}: expected auto (on a GPU), true or false")
    elif compiles(config) and config.compile_backend not in (known := compile_backends()):
        found.append(
            f"compile_backend={config.compile_backend!r} is not a torch.compile backend; known: "
            f"{', '.join(name for name in known if 'TESTING' not in name)}"
        )
    if not (config.train_encoder or config.pretrained_model_path):
        found.append(
            "train_encoder=false keeps the encoder as loaded: set pretrained_model_path (e.g. stage 1's export)"
        )
    return found


COMPILE_CHOICES = {"auto": None, "true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


def compiles(config: TrainConfig) -> bool:
    """Whether training ``torch.compile``s the model: ``compile=auto`` does on CUDA, where the
    1gpu_h100 preset's step was measured 1.24x faster compiled (docs/benchmarks.md), and not
    on CPUs, where inductor spends minutes compiling what a short run would gain back."""
    wanted = COMPILE_CHOICES[str(config.compile).lower()]
    return torch.cuda.is_available() if wanted is None else wanted


DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?")


def duration_seconds(text: str) -> float | None:
    """Seconds in "8h", "45m", "1h30m", "90s", "600", "0s" or "-3m"; None when ``text`` is not a duration."""
    sign, unsigned = (-1.0, text.strip()[1:]) if text.strip().startswith("-") else (1.0, text.strip())
    found = DURATION.fullmatch(unsigned.lower())
    if not unsigned or found is None:
        return None
    hours, minutes, seconds = (float(v) if v else 0.0 for v in found.groups())
    return sign * (3600 * hours + 60 * minutes + seconds)


def parse_duration(text: str) -> float | None:
    """Seconds in "8h", "45m", "1h30m", "90s" or "600"; None when ``text`` is not a positive duration."""
    seconds = duration_seconds(text)
    return seconds if seconds is not None and seconds > 0 else None


class LearningRateSchedule:
    """The learning-rate factor at a scheduler step: diffusers' ``constant``,
    ``constant_with_warmup``, ``cosine`` (half a cycle) and ``linear`` schedules, with a
    horizon (``total``) that a time budget sets once the run's speed is known and moves as
    it re-plans (``retarget``: the decay goes on from where it is, without a jump). Its
    attributes are plain data, so ``LambdaLR.state_dict`` saves them and a resumed run
    gets the horizon it had. A horizon of 0 (a time budget that has not planned its step
    count yet, with no step limit) means no decay yet."""

    def __init__(self, kind: str, warmup: int, total: int):
        self.kind, self.warmup, self.total = kind, warmup, total
        # the step the current horizon was set at and the share of the decay done by then
        self.anchor_step, self.anchor_progress = warmup, 0.0

    def progress(self, step: int) -> float:
        """The share of the decay done at ``step``: from the anchor's share, evenly to 1 at the horizon."""
        if not self.total:
            return 0.0
        done = float(step - self.anchor_step) / float(max(1, self.total - self.anchor_step))
        return self.anchor_progress + (1.0 - self.anchor_progress) * done

    def retarget(self, step: int, total: int) -> None:
        """Move the horizon to ``total`` at scheduler step ``step``: the rate at ``step`` stays
        what it is, and the rest of the decay is spread over the steps to the new horizon."""
        if step > self.anchor_step:
            self.anchor_step, self.anchor_progress = step, min(self.progress(step), 1.0)
        self.total = total

    def __call__(self, step: int) -> float:
        if self.kind == "constant":
            return 1.0
        if step < self.warmup:
            return float(step) / float(max(1, self.warmup))
        if self.kind == "constant_with_warmup" or not self.total:
            return 1.0
        if self.kind == "linear":
            left = float(self.total - step) / float(max(1, self.total - self.anchor_step))
            return max(0.0, (1.0 - self.anchor_progress) * left)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * self.progress(step))))


def make_optimizer(
    config: TrainConfig, model: torch.nn.Module, processes: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trained parameters and its learning-rate schedule, before Accelerate
    prepares them (a prepared scheduler steps once per process: its steps count ``processes`` each)."""
    # fused: one kernel for all parameters (5x faster than foreach on CPU at 11M parameters)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        weight_decay=config.weight_decay,
        fused=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        LearningRateSchedule(
            config.lr_scheduler, config.lr_warmup_steps * processes, config.max_train_steps * processes
        ),
    )
    return optimizer, scheduler
