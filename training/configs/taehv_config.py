"""Base training config. It sets only the fields below (data, model, reference VAE, loss
weights and optimisation of the production recipe); every other field keeps its default.
All fields, with their defaults and meaning, are in the TrainConfig dataclass in
common/config.py.

Presets (taehv_config_<name>.py) `replace` fields of this one; any field can also be
overridden on the command line: `--n_frames=9 --learning_rate=3e-4`.

This base fine-tunes the published taecvx.pth in CogVideoX-2b's latent space on the
users' driving clips at 480x720, with the distillation recipe: encoder MSE to the
reference latents, decoder MSE on the reference latents, end-to-end reconstruction MSE.
"""

from taehv_train.common.config import TrainConfig

config = TrainConfig(
    data_root="data/MiniDataset",
    annotation_file="data/MiniDataset/annotations_train.json",
    val_annotation_file="data/MiniDataset/annotations_val.json",
    n_frames=17,  # 4k+1 with k even: exact for taecvx and for CogVideoX's VAE
    height=480,
    width=720,
    variant="taecvx",
    pretrained_model_path="checkpoints/taecvx.pth",
    ref_vae_path="checkpoints/CogVideoX-2b",  # diffusers folder with a vae/ subfolder
    ref_vae_class="cogvideox",
    encoder_loss_weight=1.0,
    decoder_loss_weight=1.0,
    reconstruction_loss_weight=1.0,
    train_batch_size=2,
    gradient_accumulation_steps=4,
    learning_rate=1e-4,
    lr_scheduler="cosine",
    lr_warmup_steps=2000,
    max_train_steps=100_000,
    mixed_precision="bf16",
)
