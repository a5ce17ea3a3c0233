"""A tae_vidtok from scratch for VidTok (Microsoft, the causal KL tokenizer): 4 latent channels, 8x in
space, 4x in time; clips are 4k+1 frames (its encoder sees 3 copies of the first frame in front, as
its own forward does). The VAE folder is a local copy of the model with its vae/ subfolder."""

from taehv_train.training.configs import from_scratch_for

config = from_scratch_for("tae_vidtok", "vidtok", "checkpoints/VidTok-kl-causal-488-4chn", n_frames=17)
