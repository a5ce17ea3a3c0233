"""From scratch without a reference VAE: a plain autoencoder on the reconstruction loss, at
small sizes. This is the recipe `bench/bench_quality.py` measures against a naive loop
(docs/benchmarks.md, "Quality at equal budget"), and the base of the CPU demo preset.

What it keeps from the production recipe: AdamW (betas 0.9/0.95, weight decay 0.01),
clipping at 1.0, random crops of 0.6-1.0 of the frame and flips, decoder bias 0.5. What it
changes for short runs, measured by the ablation in docs/benchmarks.md: a constant
learning rate with no warm-up (+1 dB at 300 steps over cosine decay with 20 warm-up
steps), EMA decay 0.99 (a horizon of ~100 steps), strides 1-2.

For time to quality (docs/benchmarks.md, "Time to quality"): the training videos are kept
decoded and downscaled in memory (``frame_cache_mb``: no step waits for seeking and decoding
720p video for a 32x48 crop), and bf16 autocast where the hardware computes it natively
(GPUs, CPUs with AVX512-BF16 or AMX: 1.8x the steps per second of fp32 here), else fp32.
``--max_train_time=8m`` makes eight minutes the run's length: its 500 steps no longer apply,
and its validations, strips and checkpoints are spread over the budget
(``training/loop/time_budget.py``)."""

from taehv_train.common.config import native_bf16
from taehv_train.training.configs.taehv_config import config as base

config = base.replace(
    n_frames=9,
    height=32,
    width=48,
    stride_max=2,
    pretrained_model_path="",
    ref_vae_path="",
    train_batch_size=4,
    gradient_accumulation_steps=1,
    learning_rate=3e-4,
    lr_scheduler="constant",
    lr_warmup_steps=0,
    max_train_steps=500,
    mixed_precision="bf16" if native_bf16() else "no",
    frame_cache_mb=2048,
    ema_decay=0.99,
    dataloader_num_workers=1,
    log_every=10,
    validation_every=100,
    num_validation_samples=6,
    image_log_every=100,
    checkpointing_steps=250,
    checkpoints_total_limit=2,
)
