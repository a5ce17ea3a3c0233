"""8 x H100 80GB production run (effective batch 8 GPUs x 2 x 4 = 64)."""

from taehv_train.training.configs.taehv_config import config as base

config = base.replace(
    train_batch_size=2,
    gradient_accumulation_steps=4,
    max_train_steps=100_000,
    dataloader_num_workers=8,
    prefetch_factor=4,
)
