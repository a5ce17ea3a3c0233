"""Fine-tune the published taehv1_5 in HunyuanVideo 1.5's latent space: 32 channels, 16x in
space, 4x in time; clips are 4k+1 frames at multiples of 16. The VAE folder is a local copy
of HunyuanVideo-1.5 (diffusers format) with its vae/ subfolder."""

from taehv_train.training.configs.taehv_config import config as base

config = base.replace(
    n_frames=17,
    variant="taehv1_5",
    pretrained_model_path="checkpoints/taehv1_5.pth",
    ref_vae_path="checkpoints/HunyuanVideo-1.5",
    ref_vae_class="hunyuan15",
)
