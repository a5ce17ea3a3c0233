"""CPU demo: trains a TAECVX-architecture model from scratch on the built-in procedural
clips (`python -m training.demo_data demo_output/data`) in a few minutes. No reference VAE
(none can be downloaded here): plain autoencoder training on the reconstruction loss."""
from training.configs.taehv_config import config as base

config = base.replace(
    output_dir="demo_output/runs",
    data_root="demo_output/data",
    annotation_file="demo_output/data/annotations_train.json",
    val_annotation_file="demo_output/data/annotations_val.json",
    n_frames=9,
    height=32,
    width=48,
    stride_max=2,
    pretrained_model_path="",
    ref_vae_path="",
    train_batch_size=4,
    gradient_accumulation_steps=1,
    learning_rate=3e-4,
    lr_warmup_steps=20,
    max_train_steps=500,
    mixed_precision="no",
    ema_decay=0.99,
    dataloader_num_workers=1,
    log_every=10,
    validation_every=100,
    num_validation_samples=6,
    image_log_every=100,
    checkpointing_steps=250,
    checkpoints_total_limit=2,
)
