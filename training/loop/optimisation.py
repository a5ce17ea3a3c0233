"""The optimisation keys and their rules: precision, schedule, optimizer settings, compile.

Kept apart from ``step.py`` (which builds the optimizer, scheduler and EMA with diffusers)
so that the config check stays light: importing diffusers takes over a second.
"""
from __future__ import annotations

from training.config import TrainConfig, below

MIXED_PRECISION = ("no", "fp16", "bf16")
LR_SCHEDULERS = ("constant", "constant_with_warmup", "cosine", "linear")


def problems(config: TrainConfig) -> list[str]:
    """What is wrong with the optimisation and model keys."""
    found = below(config, ("train_batch_size", "gradient_accumulation_steps", "max_train_steps"), 1)
    found += below(config, ("max_grad_norm", "weight_decay", "lr_warmup_steps"), 0)
    if config.mixed_precision not in MIXED_PRECISION:
        found.append(f"mixed_precision must be one of {MIXED_PRECISION}")
    if config.lr_scheduler not in LR_SCHEDULERS:
        found.append(f"lr_scheduler must be one of {LR_SCHEDULERS}")
    if config.learning_rate <= 0:
        found.append("learning_rate must be > 0")
    if not 0 < config.ema_decay < 1:
        found.append("ema_decay must be in (0, 1)")
    if config.compile and config.compile_backend not in (known := compile_backends()):
        found.append(f"compile_backend={config.compile_backend!r} is not a torch.compile backend; known: "
                     f"{', '.join(name for name in known if 'TESTING' not in name)}")
    if not (config.train_encoder or config.pretrained_model_path):
        found.append("train_encoder=false keeps the encoder as loaded: set pretrained_model_path (e.g. stage 1's export)")
    return found


def compile_backends() -> list[str]:
    """The ``torch.compile`` backends this torch knows, its debugging ones (``aot_eager``,
    ``eager``) included."""
    import torch._dynamo  # seconds to import: only when compile=true is checked

    return torch._dynamo.list_backends(exclude_tags=())
