"""1 x H100 80GB: quick iteration at full resolution (effective batch 16)."""

from taehv_train.training.configs.taehv_config import config as base

config = base.replace(
    train_batch_size=2,
    gradient_accumulation_steps=8,
    max_train_steps=20_000,
    lr_warmup_steps=500,
    dataloader_num_workers=8,
)
