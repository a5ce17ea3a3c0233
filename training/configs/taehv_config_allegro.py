"""A tae_allegro from scratch for Allegro (rhymes-ai): 4 latent channels, 8x in space, 4x in time, not
causal. Its VAE encodes only in tiles of 24 frames (8 shared), so clips are 24 + 16m frames (24, 40,
...); the TAE maps 4L frames to L latents and back with nothing trimmed. The VAE folder is a local
copy of the model with its vae/ subfolder."""

from taehv_train.training.configs import from_scratch_for

config = from_scratch_for("tae_allegro", "allegro", "checkpoints/Allegro", n_frames=24)
