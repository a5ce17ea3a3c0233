"""Procedural demo videos, so that training runs end to end without a dataset.

    python -m training.demo_data OUT_DIR --num-clips 32 --frames 24 --height 96 --width 128 --seed 0

Each clip is a camera panning and zooming over a large procedurally textured scene in
which several textured objects move and rotate: enough motion, texture and occlusion
for an autoencoder to have something to learn, deterministic given the seed. Clips are
written as H.264 MP4 (``evaluation.videos.write_video``, which browsers play) to
``OUT_DIR/videos`` with ``OUT_DIR/annotations_train.json`` and ``annotations_val.json`` in
the users' format.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Sequence

import cv2
import numpy as np

from evaluation.videos import write_video
from training.make_annotations import write_annotation


def _texture(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Multi-scale noise mapped between two random colours, plus oriented stripes of a
    third colour and a little colour noise (uint8 BGR): detail at every scale."""
    noise = np.zeros((height, width), np.float32)
    for cells, weight in ((3, 0.45), (12, 0.35), (48, 0.2)):
        grid = rng.random((cells, max(2, cells * width // height)), dtype=np.float32)
        noise += weight * cv2.resize(grid, (width, height), interpolation=cv2.INTER_CUBIC)
    colours = rng.random((3, 3), dtype=np.float32)
    image = colours[0] + (colours[1] - colours[0]) * np.clip(noise, 0, 1)[..., None]
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    angle, period = rng.uniform(0, math.pi), rng.uniform(3, 12)
    stripes = np.sin((xx * math.cos(angle) + yy * math.sin(angle)) * 2 * math.pi / period) > rng.uniform(0.3, 0.9)
    image[stripes] = 0.4 * image[stripes] + 0.6 * colours[2]
    image += rng.normal(0, 0.03, image.shape).astype(np.float32)
    return np.clip(image * 255, 0, 255).astype(np.uint8)


def _sprite(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """A textured ellipse, rectangle or triangle and its mask."""
    texture = _texture(rng, size, size)
    mask = np.zeros((size, size), np.uint8)
    shape = rng.integers(3)
    if shape == 0:
        axes = (int(size * rng.uniform(0.25, 0.5)), int(size * rng.uniform(0.25, 0.5)))
        cv2.ellipse(mask, (size // 2, size // 2), axes, 0, 0, 360, 255, -1)
    elif shape == 1:
        lo, hi = int(size * rng.uniform(0, 0.25)), int(size * rng.uniform(0.75, 1))
        cv2.rectangle(mask, (lo, lo), (hi, hi), 255, -1)
    else:
        points = (rng.random((3, 2)) * size).astype(np.int32)
        cv2.fillPoly(mask, [points], 255)
    return texture, mask


def render_clip(rng: np.random.Generator, n_frames: int, height: int, width: int) -> np.ndarray:
    """``[T, H, W, 3]`` uint8 BGR frames of one procedural clip."""
    world_h, world_w = 3 * height, 3 * width
    world = _texture(rng, world_h, world_w)
    # Camera: centre pans along a line with a wobble, zoom oscillates.
    cam_start = np.array([world_w / 2, world_h / 2]) + rng.uniform(-0.3, 0.3, 2) * (width, height)
    cam_vel = rng.uniform(-2, 2, 2) * min(height, width) / 64
    zoom0, zoom_amp, zoom_freq = rng.uniform(0.9, 1.4), rng.uniform(0, 0.3), rng.uniform(0.05, 0.2)
    # Objects start around the middle of the camera path and drift with it, so most are seen.
    path_middle = cam_start + cam_vel * n_frames / 2
    objects = []
    for _ in range(int(rng.integers(3, 7))):
        size = int(min(height, width) * rng.uniform(0.25, 0.6))
        texture, mask = _sprite(rng, size)
        objects.append(
            dict(
                texture=texture,
                mask=mask,
                pos=path_middle + rng.uniform(-0.6, 0.6, 2) * (width, height),
                vel=cam_vel + rng.uniform(-2, 2, 2) * min(height, width) / 64,
                angle=rng.uniform(0, 360),
                spin=rng.uniform(-6, 6),
            )
        )

    frames = np.empty((n_frames, height, width, 3), np.uint8)
    for t in range(n_frames):
        centre = cam_start + cam_vel * t + 4 * np.sin(0.3 * t + np.arange(2))
        zoom = zoom0 * (1 + zoom_amp * math.sin(zoom_freq * t))
        # world -> screen: scale about the camera centre, then move it to the frame centre
        cam = np.array([[zoom, 0, width / 2 - zoom * centre[0]], [0, zoom, height / 2 - zoom * centre[1]]])
        frame = cv2.warpAffine(world, cam, (width, height), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT)
        for obj in objects:
            size = obj["mask"].shape[0]
            pos = obj["pos"] + obj["vel"] * t
            place = cv2.getRotationMatrix2D((size / 2, size / 2), obj["angle"] + obj["spin"] * t, 1.0)
            place[:, 2] += pos - size / 2
            to_screen = cam @ np.vstack([place, [0, 0, 1]])
            sprite = cv2.warpAffine(obj["texture"], to_screen, (width, height), flags=cv2.INTER_LINEAR)
            alpha = cv2.warpAffine(obj["mask"], to_screen, (width, height), flags=cv2.INTER_LINEAR)
            alpha = alpha[..., None].astype(np.float32) / 255
            frame = (frame * (1 - alpha) + sprite * alpha).astype(np.uint8)
        frames[t] = frame
    return frames


def make_demo_dataset(
    out_dir: str | Path,
    num_clips: int = 32,
    n_frames: int = 24,
    height: int = 96,
    width: int = 128,
    seed: int = 0,
    val_fraction: float = 0.125,
    fps: float = 24.0,
) -> dict[str, Path]:
    """Write the clips and train/val annotations; returns the annotation paths.

    The last ``round(val_fraction * num_clips)`` clips (at least one) are validation.
    """
    out_dir = Path(out_dir)
    (out_dir / "videos").mkdir(parents=True, exist_ok=True)
    entries = []
    for i in range(num_clips):
        rel = f"videos/clip_{i:05d}.mp4"
        bgr = render_clip(np.random.default_rng([seed, i]), n_frames, height, width)
        write_video(out_dir / rel, np.ascontiguousarray(bgr[..., ::-1]), fps)
        duration = round(n_frames / fps, 3)
        entries.append(
            {"path": rel, "frames": n_frames, "duration": duration, "fps": fps, "width": width, "height": height}
        )
    n_val = min(num_clips - 1, max(1, round(val_fraction * num_clips))) if num_clips > 1 else 0
    paths = {"train": out_dir / "annotations_train.json", "val": out_dir / "annotations_val.json"}
    write_annotation(paths["train"], entries[: num_clips - n_val])
    write_annotation(paths["val"], entries[num_clips - n_val :])
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--num-clips", type=int, default=32)
    parser.add_argument("--frames", type=int, default=24)
    parser.add_argument("--height", type=int, default=96)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val-fraction", type=float, default=0.125)
    parser.add_argument("--fps", type=float, default=24.0)
    args = parser.parse_args(argv)
    paths = make_demo_dataset(
        args.out_dir, args.num_clips, args.frames, args.height, args.width, args.seed, args.val_fraction, args.fps
    )
    print(f"wrote {args.num_clips} clips to {args.out_dir / 'videos'}")
    print(f"train: {paths['train']}\nval:   {paths['val']}")
    print(f"train with data_root={args.out_dir} annotation_file={paths['train']}")


if __name__ == "__main__":
    main()
