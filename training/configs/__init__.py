"""Training presets: ``taehv_config.py`` is the base, ``taehv_config_<name>.py`` replace its fields."""

from __future__ import annotations

from taehv_train.common.config import TrainConfig


def from_scratch_for(variant: str, ref_vae_class: str, ref_vae_path: str, n_frames: int, **fields) -> TrainConfig:
    """A TAE this package builds for a reference VAE with no published one
    (``models.variants.BUILT_FAMILIES``), trained from scratch in that VAE's latent space:
    the base recipe (distillation losses, 480x720, bf16, cosine schedule) at the published
    from-scratch learning rate, 3e-4 (the base's 1e-4 fine-tunes published weights)."""
    from taehv_train.training.configs.taehv_config import config as base

    return base.replace(
        n_frames=n_frames,
        variant=variant,
        pretrained_model_path="",
        ref_vae_path=ref_vae_path,
        ref_vae_class=ref_vae_class,
        learning_rate=3e-4,
        **fields,
    )
