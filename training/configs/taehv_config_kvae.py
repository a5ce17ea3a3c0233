"""A tae_kvae from scratch for KVAE (Kandinsky's video VAE): 16 latent channels, 8x in space, 4x in
time. Its posterior has unit variance, so the latents are its mean; clips are 4k+1 frames but not
21, 37, 53, ... (docs/reference_vaes.md). The VAE folder is a local copy of the model with its vae/
subfolder."""

from taehv_train.training.configs import from_scratch_for

config = from_scratch_for("tae_kvae", "kvae", "checkpoints/KVAE-video", n_frames=17)
