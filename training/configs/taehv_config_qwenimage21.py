"""A tae_qwenimage2_1 from scratch for Qwen-Image 2.1 (AutoencoderKLQwenImage21): RGBA images in
and out, 64 latent channels, 16x in space, one image per sample (T = 1). Point data_root at a
folder of RGBA PNG/WebP images (scanned, each a one-frame clip; videos in it count as opaque) or
annotation_file at a list of them with "frames": 1. The VAE folder is a local copy of the model
with its vae/ subfolder."""

from taehv_train.training.configs import from_scratch_for

config = from_scratch_for("tae_qwenimage2_1", "qwenimage21", "checkpoints/Qwen-Image-2.1", n_frames=1)
