"""Tiny config for tests and smoke runs: a few steps at 32x32 with 5 frames."""
from training.configs.taehv_config import config as base

config = base.replace(
    output_dir="output/test",
    data_root="demo_output/data",
    annotation_file="demo_output/data/annotations_train.json",
    val_annotation_file="demo_output/data/annotations_val.json",
    n_frames=9,
    height=32,
    width=32,
    pretrained_model_path="",
    ref_vae_path="",
    train_batch_size=1,
    gradient_accumulation_steps=1,
    learning_rate=1e-3,
    lr_scheduler="constant",
    lr_warmup_steps=0,
    max_train_steps=4,
    mixed_precision="no",
    dataloader_num_workers=0,
    log_every=1,
    validation_every=2,
    num_validation_samples=2,
    image_log_every=2,
    checkpointing_steps=2,
    checkpoints_total_limit=2,
)
