"""A tae_svd from scratch for Stable Video Diffusion (AutoencoderKLTemporalDecoder): 4 latent channels,
8x in space, no temporal compression (a per-frame encoder, a decoder that mixes the frames of a
clip); any clip length, 14 as the released model generates. The VAE folder is a local copy of the
model with its vae/ subfolder."""

from taehv_train.training.configs import from_scratch_for

config = from_scratch_for("tae_svd", "svd", "checkpoints/stable-video-diffusion-img2vid-xt", n_frames=14)
