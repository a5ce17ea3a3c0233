"""Fine-tune the published taew2_2 in Wan 2.2's (TI2V-5B) latent space: 48 channels, 16x in
space, 4x in time; clips are 4k+1 frames at multiples of 16. The VAE folder is a local copy
of Wan2.2-TI2V-5B-Diffusers with its vae/ subfolder."""

from taehv_train.training.configs.taehv_config import config as base

config = base.replace(
    n_frames=17,
    variant="taew2_2",
    pretrained_model_path="checkpoints/taew2_2.pth",
    ref_vae_path="checkpoints/Wan2.2-TI2V-5B",
    ref_vae_class="wan",
)
