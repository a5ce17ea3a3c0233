"""A tae_cosmos from scratch for Cosmos 1.0 (NVIDIA, CV8x8x8): 16 latent channels, 8x in space, 8x in
time (Haar patching); clips are 8k+1 frames. Its VAE runs in fp32 or on a GPU (bf16 average pooling
is missing on CPU). The VAE folder is a local copy of the model with its vae/ subfolder."""

from taehv_train.training.configs import from_scratch_for

config = from_scratch_for("tae_cosmos", "cosmos", "checkpoints/Cosmos-1.0-Diffusion-7B-Text2World", n_frames=17)
