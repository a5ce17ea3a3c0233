"""What the evaluation shows of a sample: uint8 frames, RGBA shown beside its alpha, labelled
side-by-side comparisons and a picture of the latents (``common.video.writer`` writes the videos)."""

from __future__ import annotations

import cv2
import numpy as np
import torch


def to_uint8_frames(video: torch.Tensor) -> np.ndarray:
    """TCHW float in [0, 1] -> THWC uint8 RGB (or RGBA)."""
    return video.detach().float().clamp(0, 1).mul(255).round().byte().permute(0, 2, 3, 1).cpu().numpy()


def rgb_beside_alpha(frames: np.ndarray) -> np.ndarray:
    """THWC uint8 frames as a video can show them: RGB frames as they are, RGBA ones as their
    colours with the alpha channel in grey beside them (video codecs drop alpha)."""
    if frames.shape[3] == 3:
        return frames
    return np.concatenate([frames[..., :3], np.repeat(frames[..., 3:], 3, axis=3)], axis=2)


def side_by_side(
    left: np.ndarray, right: np.ndarray, labels: tuple[str, str] = ("original", "TAEHV"), min_height: int = 256
) -> np.ndarray:
    """Two THWC uint8 videos next to each other, each with its label burnt in; clips lower
    than ``min_height`` are enlarged by a whole factor (bicubic, as the stills) first, so
    that the labels are legible and the picture is not blocks."""
    factor = -(-min_height // left.shape[1])
    if factor > 1:
        size = (left.shape[2] * factor, left.shape[1] * factor)
        left, right = (np.stack([cv2.resize(f, size, interpolation=cv2.INTER_CUBIC) for f in v]) for v in (left, right))
    out = np.ascontiguousarray(np.concatenate([left, right], axis=2))  # OpenCV draws into C-ordered frames only
    width = left.shape[2]
    font_scale = left.shape[1] / 400  # text ~5% of the height
    stroke = max(1, round(font_scale * 1.5))  # strokes grow with the text, so that large labels stay one word
    for frame in out:
        for i, label in enumerate(labels):
            org = (i * width + 8, int(26 * font_scale) + 6)
            cv2.putText(frame, label, org, cv2.FONT_HERSHEY_SIMPLEX, font_scale, (0, 0, 0), stroke + 3, cv2.LINE_AA)
            cv2.putText(frame, label, org, cv2.FONT_HERSHEY_SIMPLEX, font_scale, (255, 255, 255), stroke, cv2.LINE_AA)
    return out


MIN_LATENT_SIDE = 128  # pixels: a latent frame's tile is enlarged until its shorter side is at least this
MAX_LATENT_WIDTH = 1200  # pixels: latent frames beyond this width go on to the next row


def latent_picture(latents: torch.Tensor, scale: int | None = None) -> np.ndarray:
    """HWC uint8 RGB image of TCHW latents: the 3 principal components of the channels,
    one tile per latent frame in rows of at most MAX_LATENT_WIDTH pixels, so structure and
    temporal change are visible. Each latent
    is a ``scale`` x ``scale`` block (nearest neighbour: one value, one block; default: the
    whole factor that makes a tile's shorter side at least MIN_LATENT_SIDE pixels)."""
    t, c, h, w = latents.shape
    scale = scale or max(1, -(-MIN_LATENT_SIDE // min(h, w)))
    flat = latents.detach().float().cpu().permute(0, 2, 3, 1).reshape(-1, c)
    flat = flat - flat.mean(0)
    # exact PCA from the channel covariance (pca_lowrank is randomised: pictures varied run to
    # run), each component's sign fixed by its largest entry; tiny latents: fewer than 3
    _, vectors = torch.linalg.eigh(flat.T @ flat)
    v = vectors.flip(1)[:, : min(3, *flat.shape)]
    v = v * v.gather(0, v.abs().argmax(0, keepdim=True)).sign()
    rgb = flat @ v
    lo, hi = rgb.quantile(0.01, 0), rgb.quantile(0.99, 0)
    rgb = ((rgb - lo) / (hi - lo).clamp_min(1e-6)).clamp(0, 1)
    if rgb.shape[1] < 3:
        rgb = torch.cat([rgb, rgb[:, :1].expand(-1, 3 - rgb.shape[1])], 1)
    tiles = list((rgb.reshape(t, h, w, 3) * 255).round().byte().numpy())
    columns = max(1, min(t, MAX_LATENT_WIDTH // ((w + 2) * scale)))
    rows = -(-t // columns)
    tiles += [np.full_like(tiles[0], 255)] * (rows * columns - t)  # the last row filled with white
    below = 2 if rows > 1 else 0
    padded = [np.pad(tile, ((0, below), (0, 2), (0, 0)), constant_values=255) for tile in tiles]
    grid = np.concatenate([np.concatenate(padded[r * columns : (r + 1) * columns], axis=1) for r in range(rows)])
    return cv2.resize(grid, (grid.shape[1] * scale, grid.shape[0] * scale), interpolation=cv2.INTER_NEAREST)
