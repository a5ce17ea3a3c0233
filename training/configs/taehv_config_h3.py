"""Fine-tune the published taeh3 in MiniMax H3's latent space: 24 channels, 16x in space,
time in 17-frame chunks (docs/h3_alignment.md). H3's VAE decodes nothing up to 17 frames
and taeh3 decodes 17c - 12 frames of c chunks exactly, so clips are 22 frames (or 39,
56, ...) at multiples of 16. The VAE folder is a local copy of the MiniMax H3 model with
its vae/ subfolder."""

from taehv_train.training.configs.taehv_config import config as base

config = base.replace(
    n_frames=22,
    variant="taeh3",
    pretrained_model_path="checkpoints/taeh3.pth",
    ref_vae_path="checkpoints/MiniMax-H3",
    ref_vae_class="h3",
)
