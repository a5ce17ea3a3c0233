"""Shared test fixtures: where the read-only shared data lives.

Tests read real clips and compatibility fixtures from ``../shared`` (next to the repo),
overridable with ``TAEHV_SHARED_DIR``. A missing directory skips those tests on a
developer machine but fails them in CI (``CI=true``), so CI can never go green by
silently skipping the compatibility and real-video checks.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def shared_dir() -> Path:
    return Path(os.environ.get("TAEHV_SHARED_DIR", REPO_ROOT.parent / "shared")).resolve()


def _require(path: Path, what: str) -> Path:
    if path.exists():
        return path
    message = f"{what} not found at {path} (set TAEHV_SHARED_DIR to the shared/ folder)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def compat_dir() -> Path:
    return _require(shared_dir() / "compat", "compat fixtures")


@pytest.fixture(scope="session")
def videos_dir() -> Path:
    return _require(shared_dir() / "videos", "shared video clips")


@pytest.fixture(scope="session")
def demo_clips(tmp_path_factory) -> dict[str, Path]:
    """Six procedural clips (48x64, 12 frames) with train/val annotations, for training runs."""
    from training.demo_data import make_demo_dataset

    root = tmp_path_factory.mktemp("demo_clips")
    paths = make_demo_dataset(root, num_clips=6, n_frames=12, height=48, width=64, seed=1)
    return {"root": root, **paths}


@pytest.fixture(scope="session")
def tiny_cogvideox_vae(tmp_path_factory) -> Path:
    """A tiny CogVideoX VAE (16 latent channels) saved by diffusers, for the real loading path."""
    import torch
    from diffusers import AutoencoderKLCogVideoX

    root = tmp_path_factory.mktemp("cogvideox")
    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(
        block_out_channels=(16, 16, 32, 32), latent_channels=16, layers_per_block=1, norm_num_groups=8,
        down_block_types=("CogVideoXDownBlock3D",) * 4, up_block_types=("CogVideoXUpBlock3D",) * 4)
    vae.save_pretrained(root / "vae")
    return root
