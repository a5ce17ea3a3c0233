"""Fine-tune the published taeltx2_3 in LTX-2.3's latent space (LTX-2.5 uses the same VAE).

LTX's VAE compresses 32x in space and 8x in time: clips are 8k+1 frames (25 here; 121 is
LTX-2's own length) at multiples of 32 (480x704 keeps the driving clips' 720x480 framing
nearly whole). The VAE folder is a local copy of the LTX-2.3 model with its vae/ subfolder.
"""

from taehv_train.training.configs.taehv_config import config as base

config = base.replace(
    n_frames=25,  # 8k+1: what LTX's VAE takes and taeltx2_3 decodes exactly
    height=480,
    width=704,
    variant="taeltx2_3",
    pretrained_model_path="checkpoints/taeltx2_3.pth",
    ref_vae_path="checkpoints/LTX-2.3",
    ref_vae_class="ltx2",
)
