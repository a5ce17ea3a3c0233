"""Progressive recipe, stage 1 of 2: the whole model at half resolution (240x360).

VidTok's authors report that training at low resolution, then fine-tuning only the
decoder at the target resolution, reaches the same quality in about half the GPU hours.
Stage 1 moves the encoder (and so the latent space) to the data cheaply; its run ends by
writing output/progressive_stage1/export/taecvx.pth, which stage 2 starts from:

    ./train_taehv_h100.sh 8 progressive_stage1
    ./train_taehv_h100.sh 8 progressive_stage2
"""

from taehv_train.training.configs.taehv_config import config as base

config = base.replace(
    run_name="progressive_stage1",
    height=240,
    width=360,
    max_train_steps=50_000,
)
