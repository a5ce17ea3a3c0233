"""Our TAEHV next to the published one: the same weights, the same calls, the same loss.

Benchmarks that compare the two on CPU (bench/bench_speed.py, bench/bench_train_speed.py,
bench/bench_time_to_quality.py) build and call them through these.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from bench.lib.harness import load_published, published_file
from taehv_train.models.taehv import TAEHV


def build_pair(
    variant: str, workdir: Path, seed: int = 0, published_path: Path | None = None
) -> tuple[TAEHV, torch.nn.Module, Path]:
    """Ours (seeded random init) and the published model with the same weights, loaded by the
    published constructor (of ``published_path``, by default the shared folder's file) from
    a file under the published name."""
    torch.manual_seed(seed)
    ours = TAEHV(variant=variant).eval()
    checkpoint = workdir / f"{variant}.pth"
    torch.save(ours.state_dict(), checkpoint)
    module = load_published(published_path or published_file(variant))
    published = module.TAEHV(checkpoint_path=str(checkpoint)).eval()
    return ours, published, checkpoint


def operation(
    model: torch.nn.Module, published: bool, op: str, parallel: bool, x: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """``encode_video`` or ``decode_video`` of ``x``, as a call of no arguments."""
    kwargs = {"show_progress_bar": False} if published else {}
    fn = model.encode_video if op == "encode" else model.decode_video
    return lambda: fn(x, parallel=parallel, **kwargs)


def published_loss(module: ModuleType, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """MSE of the published ``model``'s reconstruction of ``x``, decoded through ``module``'s
    ``apply_model_with_memblocks`` without ``decode_video``'s in-place clamp to [0, 1]: the
    loss ours trains on."""
    z = model.encode_video(x, show_progress_bar=False)
    decoded = module.apply_model_with_memblocks(model.decoder, z, True, False)[:, model.frames_to_trim :]
    decoded = F.pixel_shuffle(decoded, model.patch_size)
    return F.mse_loss(decoded.float(), x[:, : decoded.shape[1]])
