"""2 nodes x 8 H100 (16 GPUs, effective batch 16 x 2 x 2 = 64)."""

from taehv_train.training.configs.taehv_config import config as base

config = base.replace(
    train_batch_size=2,
    gradient_accumulation_steps=2,
    max_train_steps=100_000,
    dataloader_num_workers=8,
    prefetch_factor=4,
)
