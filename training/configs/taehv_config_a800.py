"""8 x A800 80GB test of the production recipe (5k steps, effective batch 8 x 1 x 8 = 64)."""

from taehv_train.training.configs.taehv_config import config as base

config = base.replace(
    train_batch_size=1,
    gradient_accumulation_steps=8,
    max_train_steps=5_000,
    lr_warmup_steps=500,
    validation_every=500,
    checkpointing_steps=500,
    dataloader_num_workers=8,
)
