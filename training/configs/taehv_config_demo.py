"""CPU demo (`make demo`): the from-scratch preset (taehv_config_scratch.py: TAECVX
architecture, no reference VAE, plain autoencoder on the reconstruction loss) on the
built-in procedural driving clips (`python -m taehv_train.training.demo_data demo_output/data`, 96x144),
in about 12 minutes on 2 CPU cores (set-up included).

Measured choices (docs/benchmarks.md, "Demo training run"): crops at the scale of the
footage (32x48 from 1/9 to 1/4 of the frame, so at most 1.5x downscaled) keep lane markings
and vehicles as large as in the held-out clips, which are validated whole at 96x144; batch 2
makes more optimizer steps per minute than batch 4 and learns more per minute from scratch;
lr 6e-4 beats 3e-4 and 1e-3; over 2000-2600 steps cosine decay (50 warm-up steps) ends 0.3-0.4 dB
above the from-scratch preset's constant rate, which wins in runs of a few hundred steps."""

from taehv_train.training.configs.taehv_config_scratch import config as scratch

config = scratch.replace(
    output_dir="demo_output/runs",
    data_root="demo_output/data",
    annotation_file="demo_output/data/annotations_train.json",
    val_annotation_file="demo_output/data/annotations_val.json",
    crop_scale_min=0.111,  # (32x48) / (96x144): the held-out clips' scale
    crop_scale_max=0.25,
    val_height=96,
    val_width=144,
    train_batch_size=2,
    mixed_precision="no",  # the step count is fixed, so bf16 would only end it sooner; its measured curve is fp32
    learning_rate=6e-4,
    lr_scheduler="cosine",
    lr_warmup_steps=50,
    max_train_steps=2600,
    log_every=20,
    validation_every=200,
    image_log_every=400,
    checkpointing_steps=1300,
)
