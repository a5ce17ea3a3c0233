"""Tiny config for tests and smoke runs: a few steps at 32x32 on the demo clips."""
from training.configs.taehv_config_demo import config as demo

config = demo.replace(
    output_dir="output/test",
    width=32,
    train_batch_size=1,
    learning_rate=1e-3,
    lr_scheduler="constant",
    lr_warmup_steps=0,
    max_train_steps=4,
    dataloader_num_workers=0,
    log_every=1,
    validation_every=2,
    num_validation_samples=2,
    image_log_every=2,
    checkpointing_steps=2,
    checkpoints_total_limit=2,
)
