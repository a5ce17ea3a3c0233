"""Still frames that show what was and was not reconstructed.

One picture per sample: a row per chosen frame, columns original | TAEHV | (reference VAE)
| |TAEHV - original| as a heat map, amplified. Every tile keeps its clip's aspect ratio:
a small clip is enlarged with a smooth (bicubic) filter until its shorter side is 256
pixels, legible without blocks; a large one is reduced (area filter) until its longer side
is 640 pixels, so that a report of full-HD clips stays light (the videos keep every pixel).
A header band names the columns. RGBA clips give an RGBA picture: each image tile
keeps its alpha (saved as a PNG with alpha), the bands and the heat map are opaque.
"""

from __future__ import annotations

import cv2
import numpy as np

HEADER_HEIGHT = 28
GAP = 4
MIN_SIDE, MAX_SIDE = 256, 640  # a tile's shorter side at least, its longer side at most (the shorter wins)


def frame_indices(frames: int, count: int = 3) -> list[int]:
    """``count`` evenly spaced frame indices (first, ..., last) of a ``frames``-frame clip."""
    n = min(count, frames)
    return sorted({round(i * (frames - 1) / max(n - 1, 1)) for i in range(n)})


def difference_heat_map(original: np.ndarray, reconstructed: np.ndarray, amplify: float) -> np.ndarray:
    """HWC uint8 RGB heat map of the mean absolute difference over channels, times ``amplify``
    (near black: exact; yellow: off by 255 / amplify or more; matplotlib's inferno)."""
    error = np.abs(original.astype(np.int16) - reconstructed.astype(np.int16)).mean(axis=2)
    scaled = np.clip(error * amplify, 0, 255).astype(np.uint8)
    return cv2.cvtColor(cv2.applyColorMap(scaled, cv2.COLORMAP_INFERNO), cv2.COLOR_BGR2RGB)


def tile_size(height: int, width: int) -> tuple[int, int]:
    """(height, width) of the tile of a ``height x width`` frame: same aspect ratio, the
    shorter side at least MIN_SIDE, the longer at most MAX_SIDE where the shorter allows."""
    short, long = min(height, width), max(height, width)
    scale = MIN_SIDE / short if short < MIN_SIDE else max(MIN_SIDE / short, min(1.0, MAX_SIDE / long))
    return round(height * scale), round(width * scale)


def resize_tile(tile: np.ndarray, height: int, width: int) -> np.ndarray:
    """``tile`` at ``height x width``: bicubic when enlarging, area when reducing."""
    if tile.shape[:2] == (height, width):
        return tile
    enlarging = height > tile.shape[0]
    return cv2.resize(tile, (width, height), interpolation=cv2.INTER_CUBIC if enlarging else cv2.INTER_AREA)


def _label(band: np.ndarray, text: str, x: int) -> None:
    cv2.putText(band, text, (x + 6, HEADER_HEIGHT - 9), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (255, 255, 255), 1, cv2.LINE_AA)


def comparison_stills(
    original: np.ndarray,
    reconstructed: np.ndarray,
    reference: np.ndarray | None = None,
    count: int = 3,
    amplify: float = 4.0,
) -> tuple[np.ndarray, list[int]]:
    """(HWC uint8 RGB or RGBA picture, frame indices shown) for THWC uint8 RGB or RGBA videos
    of the same size; ``reference`` (the reference VAE's reconstruction) may have fewer frames."""
    frames = len(original) if reference is None else min(len(original), len(reference))
    indices = frame_indices(frames, count)
    tile_h, tile_w = tile_size(*original.shape[1:3])
    columns = [("original", original), ("TAEHV", reconstructed)]
    if reference is not None:
        columns.append(("reference VAE", reference))
    titles = [name for name, _ in columns] + [f"|TAEHV - original| x{amplify:g}"]
    width = len(titles) * tile_w + (len(titles) - 1) * GAP
    canvas = np.full((HEADER_HEIGHT + len(indices) * (tile_h + GAP), width, 3), 32, np.uint8)
    # RGBA: the colours are drawn on the canvas, the alpha on its own plane (OpenCV's
    # anti-aliased text does not blend a fourth channel), opaque but for the image tiles
    alpha = np.full(canvas.shape[:2], 255, np.uint8) if original.shape[3] == 4 else None
    for c, title in enumerate(titles):
        _label(canvas[:HEADER_HEIGHT], title, c * (tile_w + GAP))
    for r, t in enumerate(indices):
        tiles = [video[t] for _, video in columns] + [difference_heat_map(original[t], reconstructed[t], amplify)]
        y = HEADER_HEIGHT + r * (tile_h + GAP)
        for c, tile in enumerate(tiles):
            x = c * (tile_w + GAP)
            shown = resize_tile(tile, tile_h, tile_w)
            canvas[y : y + tile_h, x : x + tile_w] = shown[..., :3]
            if alpha is not None and shown.shape[2] == 4:
                alpha[y : y + tile_h, x : x + tile_w] = shown[..., 3]
        label = (f"frame {t}", (6, y + tile_h - 8), cv2.FONT_HERSHEY_SIMPLEX, 0.45)
        cv2.putText(canvas, *label, (0, 0, 0), 3, cv2.LINE_AA)
        cv2.putText(canvas, *label, (255, 255, 255), 1, cv2.LINE_AA)
        if alpha is not None:
            cv2.putText(alpha, *label, 255, 3, cv2.LINE_AA)  # the label opaque on a transparent tile
    return (canvas if alpha is None else np.dstack([canvas, alpha])), indices
