"""A tae_easyanimate from scratch for EasyAnimate (AutoencoderKLMagvit): 16 latent channels, 8x in
space, 4x in time; clips are 4k+1 frames. The VAE folder is a local copy of the model with its vae/
subfolder."""

from taehv_train.training.configs import from_scratch_for

config = from_scratch_for("tae_easyanimate", "easyanimate", "checkpoints/EasyAnimateV5.1-12b-zh", n_frames=17)
