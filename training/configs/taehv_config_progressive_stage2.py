"""Progressive recipe, stage 2 of 2: the decoder only, at the target resolution (480x720),
from stage 1's export; the encoder, and so the latent space, stays as stage 1 left it
(train_encoder=False). See taehv_config_progressive_stage1.py."""

from taehv_train.training.configs.taehv_config import config as base

config = base.replace(
    run_name="progressive_stage2",
    pretrained_model_path="output/progressive_stage1/export/taecvx.pth",
    train_encoder=False,
    max_train_steps=50_000,
    learning_rate=5e-5,
    lr_warmup_steps=500,
)
