"""A tae_mochi from scratch for Mochi 1 (Genmo): 12 latent channels, 8x in space, 6x in time (the TAE
pools time 2x, then 3x); clips are 6k+1 frames. The VAE folder is a local copy of the model with its
vae/ subfolder."""

from taehv_train.training.configs import from_scratch_for

config = from_scratch_for("tae_mochi", "mochi", "checkpoints/mochi-1-preview", n_frames=13)
