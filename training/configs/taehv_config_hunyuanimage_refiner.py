"""A tae_hunyuanimage_refiner from scratch for HunyuanImage 2.1's refiner
(AutoencoderKLHunyuanImageRefiner): 32 latent channels, 16x in space and, although its config
says temporal_compression_ratio=4, one latent per frame (diffusers' temporal stages keep every
frame; docs/reference_vaes.md). Its pipeline refines single images (T = 1); 5-frame clips train the
first frame as that case and the frames after it as the VAE's causal time axis. The VAE folder
is a local copy of the model with its vae/ subfolder."""

from taehv_train.training.configs import from_scratch_for

config = from_scratch_for(
    "tae_hunyuanimage_refiner", "hunyuanimage_refiner", "checkpoints/HunyuanImage-2.1-refiner", n_frames=5
)
