"""Procedural driving clips, so that training runs end to end without a dataset.

    python -m taehv_train.training.demo_data OUT_DIR --num_clips 32 --frames 24 --height 96 --width 144 --seed 0

The first users train on driving scenes at 720x480, so each clip is one: a camera in the
right lane of a (possibly curving) road in perspective, dashed lane markings and edge lines
that move with the camera, vehicles in both directions that move and change scale,
roadside posts, a sky gradient with drifting clouds, hills, textured verges, tree shadows
and a slowly changing light, at the users' 3:2 aspect by default. Everything is drawn from
the seed (clip ``i`` of seed ``s`` uses ``default_rng([s, i])``; held-out clips are the last
ones, so they come from other seeds' streams), and the scenes keep fine structure (lane
dashes, vehicle edges, texture) for the model to learn. The pixels repeat exactly; the
H.264 bytes do not quite (libx264 varies between runs, docs/benchmarks.md). Clips are
written as H.264 MP4 (``common.video_writer.write_video``, which browsers play) to
``OUT_DIR/videos`` with ``OUT_DIR/annotations_train.json`` and ``annotations_val.json`` in
the users' format.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

import cv2
import numpy as np

from taehv_train.base.flags import ArgumentParser
from taehv_train.common.video.writer import write_video
from taehv_train.training.annotate.annotation_files import write_annotation

SUPERSAMPLE = 2  # rendered at twice the size, then area-resized: smooth edges on lane dashes and cars


def _noise(rng: np.random.Generator, size: int, scales: Sequence[tuple[int, float]]) -> np.ndarray:
    """Tileable multi-scale value noise in [0, 1] (float32, size x size)."""
    out = np.zeros((size, size), np.float32)
    for cells, weight in scales:
        grid = rng.random((cells, cells), dtype=np.float32)
        tiled = np.tile(grid, (3, 3))  # wrap around so that the texture tiles
        up = cv2.resize(tiled, (3 * size, 3 * size), interpolation=cv2.INTER_CUBIC)[size : 2 * size, size : 2 * size]
        out += weight * up
    return np.clip(out / sum(w for _, w in scales), 0, 1)


def _sample(texture: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``texture`` (tileable) looked up at texel coordinates (u, v), wrapping around."""
    return cv2.remap(texture, u.astype(np.float32), v.astype(np.float32), cv2.INTER_LINEAR, borderMode=cv2.BORDER_WRAP)


def _colour(rng: np.random.Generator, base: Sequence[float], spread: float) -> np.ndarray:
    return np.clip(np.asarray(base, np.float32) + rng.uniform(-spread, spread, 3).astype(np.float32), 0, 1)


class _Scene:
    """One driving clip's world, drawn frame by frame from a camera in the right lane."""

    ROAD_HALF, LANE, CAMERA_HEIGHT, DASH_PERIOD, DASH_LENGTH = 3.6, 1.8, 1.4, 9.0, 3.0

    def __init__(self, rng: np.random.Generator, height: int, width: int):
        self.h, self.w = height * SUPERSAMPLE, width * SUPERSAMPLE
        self.focal = 0.9 * self.w
        self.speed = rng.uniform(0.5, 1.4)  # metres per frame
        self.curve, self.curve_change = rng.uniform(-0.004, 0.004), rng.uniform(-0.0002, 0.0002)
        self.sway = (rng.uniform(0, 0.35), rng.uniform(0.05, 0.2), rng.uniform(0, 2 * math.pi))
        self.pitch = (rng.uniform(0, 0.01), rng.uniform(0.2, 0.6))
        self.light = (rng.uniform(0.05, 0.18), rng.uniform(0.05, 0.25), rng.uniform(0, 2 * math.pi))
        self.sky_top, self.sky_horizon = _colour(rng, (0.25, 0.45, 0.8), 0.15), _colour(rng, (0.75, 0.8, 0.85), 0.1)
        self.asphalt = _colour(rng, (0.33, 0.33, 0.35), 0.06)
        self.verge = _colour(rng, (0.3, 0.45, 0.2), 0.12)
        self.hills = _colour(rng, (0.3, 0.38, 0.35), 0.08)
        self.line_colour = np.float32([0.95, 0.95, 0.9]) if rng.random() < 0.6 else np.float32([0.95, 0.8, 0.2])
        self.grain = _noise(rng, 256, ((64, 0.5), (128, 0.5)))  # asphalt and verge grain
        self.patches = _noise(rng, 256, ((4, 0.6), (16, 0.4)))  # large patches: grass, repairs, shade
        self.clouds = _noise(rng, 256, ((3, 0.5), (8, 0.35), (24, 0.15)))
        self.ridge = _noise(rng, 256, ((6, 0.7), (24, 0.3)))[0]
        self.posts = rng.uniform(8, 20)  # roadside posts every this many metres
        self.vehicles = [self._vehicle(rng) for _ in range(int(rng.integers(2, 6)))]

    def _vehicle(self, rng: np.random.Generator) -> dict:
        oncoming = rng.random() < 0.4
        return dict(
            lane=-self.LANE if oncoming else self.LANE,
            z0=rng.uniform(6, 45),
            speed=-rng.uniform(0.4, 1.2) if oncoming else self.speed + rng.uniform(-0.35, 0.35),
            colour=_colour(
                rng,
                rng.choice([(0.8, 0.1, 0.1), (0.1, 0.2, 0.7), (0.9, 0.9, 0.9), (0.15, 0.15, 0.15), (0.8, 0.7, 0.1)]),
                0.08,
            ),
            size=(rng.uniform(1.7, 2.1), rng.uniform(1.3, 1.9)),
            oncoming=oncoming,
        )

    def _road_offset(self, z: np.ndarray | float, t: int) -> np.ndarray | float:
        """Lateral position of the road centre at distance z, relative to the camera."""
        curve = self.curve + self.curve_change * t
        amplitude, frequency, phase = self.sway
        return curve * np.square(z) - (self.LANE + amplitude * math.sin(frequency * t + phase))

    def frame(self, t: int) -> np.ndarray:
        h, w, f = self.h, self.w, self.focal
        travelled = self.speed * t
        horizon = h * (0.42 + self.pitch[0] * math.sin(self.pitch[1] * t))
        ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)

        # sky, clouds drifting slowly, and a ridge of hills on the horizon
        height_above = np.clip((horizon - ys) / max(horizon, 1), 0, 1)[..., None]
        image = self.sky_horizon + (self.sky_top - self.sky_horizon) * height_above
        clouds = _sample(self.clouds, xs * 0.6 + 0.3 * t, ys * 0.9)[..., None]
        image = image + (1 - image) * np.clip(clouds - 0.45, 0, 1) * 1.4 * height_above
        ridge = horizon - (0.04 + 0.08 * self.ridge[(np.arange(w) * 256 // w + int(0.2 * t)) % 256]) * h
        hills = (ys > ridge[None, :]) & (ys <= horizon)
        image[hills] = self.hills * (0.85 + 0.3 * _sample(self.patches, xs, ys * 2)[hills][:, None])

        # the ground in perspective: distance z and lateral position u (0 at the road centre)
        below = ys > horizon + 0.5
        z = np.where(below, f * self.CAMERA_HEIGHT / np.maximum(ys - horizon, 0.5), 1e4)
        u = (xs - w / 2) * z / f - self._road_offset(z, t)
        along = z + travelled
        grain = _sample(self.grain, u * 24, along * 24)
        patches = _sample(self.patches, u * 3, along * 3)
        on_road = np.abs(u) < self.ROAD_HALF
        ground = np.where(
            on_road[..., None],
            self.asphalt * (0.8 + 0.4 * grain)[..., None],
            self.verge * (0.55 + 0.45 * patches + 0.3 * grain)[..., None],
        )
        dashes = (np.abs(u) < 0.12) & (np.mod(along, self.DASH_PERIOD) < self.DASH_LENGTH)
        edges = np.abs(np.abs(u) - (self.ROAD_HALF - 0.25)) < 0.1
        ground[dashes | edges] = self.line_colour
        shade = 1 - 0.35 * (_sample(self.patches, u * 0.7 + 40, along * 0.5) > 0.62)  # tree shadows across the road
        ground = ground * shade[..., None]
        fog = np.exp(-z / 90)[..., None]
        ground = ground * fog + self.sky_horizon * (1 - fog)
        image = np.where(below[..., None], ground, image)
        image = np.ascontiguousarray((np.clip(image, 0, 1) * 255).astype(np.uint8))

        # roadside posts and vehicles, far to near
        things = [
            (d, "post", side)
            for side in (-1, 1)
            for d in np.arange(self.posts - np.mod(travelled, self.posts), 80, self.posts)
        ]
        things += [(v["z0"] + (v["speed"] - self.speed) * t, "vehicle", v) for v in self.vehicles]
        for distance, kind, what in sorted(things, key=lambda thing: -thing[0]):
            if distance < 1.5:
                continue
            scale = f / distance
            ground_y = horizon + scale * self.CAMERA_HEIGHT
            if kind == "post":
                x = w / 2 + scale * (self._road_offset(distance, t) + what * (self.ROAD_HALF + 1.2))
                self._box(image, x, ground_y, 0.15 * scale, 2.2 * scale, (235, 235, 225))
                self._box(image, x, ground_y - 1.6 * scale, 0.16 * scale, 0.3 * scale, (220, 40, 30))
            else:
                x = w / 2 + scale * (self._road_offset(distance, t) + what["lane"])
                self._vehicle_sprite(image, what, x, ground_y, scale)
        gain, frequency, phase = self.light
        lit = image.astype(np.float32) * (1 + gain * math.sin(frequency * t + phase))
        return np.clip(lit, 0, 255).astype(np.uint8)

    @staticmethod
    def _box(image: np.ndarray, x: float, bottom: float, width: float, height: float, colour) -> None:
        """A filled box whose bottom centre is at (x, bottom)."""
        left, right = int(round(x - width / 2)), int(round(x + width / 2))
        top = int(round(bottom - height))
        if right >= 0 and left < image.shape[1] and int(round(bottom)) >= 0 and top < image.shape[0]:
            cv2.rectangle(
                image, (left, top), (max(right - 1, left), int(round(bottom)) - 1), tuple(int(c) for c in colour), -1
            )

    def _vehicle_sprite(self, image: np.ndarray, vehicle: dict, x: float, bottom: float, scale: float) -> None:
        width, height = vehicle["size"][0] * scale, vehicle["size"][1] * scale
        body = vehicle["colour"] * 255
        cv2.ellipse(
            image,
            (int(x), int(bottom)),
            (max(int(width * 0.6), 1), max(int(height * 0.12), 1)),
            0,
            0,
            360,
            (25, 25, 25),
            -1,
        )  # shadow
        self._box(image, x, bottom - 0.1 * height, width, 0.6 * height, body)
        self._box(image, x, bottom - 0.65 * height, 0.8 * width, 0.35 * height, body * 0.8)
        self._box(image, x, bottom - 0.68 * height, 0.66 * width, 0.25 * height, (40, 50, 60))  # window
        lights = (250, 240, 180) if vehicle["oncoming"] else (220, 20, 20)
        for side in (-1, 1):
            self._box(image, x + side * 0.38 * width, bottom - 0.45 * height, 0.18 * width, 0.1 * height, lights)
            self._box(image, x + side * 0.35 * width, bottom, 0.2 * width, 0.14 * height, (15, 15, 15))  # wheels
        self._box(image, x, bottom - 0.2 * height, 0.3 * width, 0.08 * height, (230, 230, 230))  # number plate


def render_clip(rng: np.random.Generator, n_frames: int, height: int, width: int) -> np.ndarray:
    """``[T, H, W, 3]`` uint8 RGB frames of one procedural driving clip: a road in
    perspective with dashed lane markings that move with the camera, vehicles in both
    directions that move and change scale, roadside posts, a sky gradient with clouds,
    hills, textured verges, tree shadows and a slowly changing light."""
    scene = _Scene(rng, height, width)
    frames = np.empty((n_frames, height, width, 3), np.uint8)
    for t in range(n_frames):
        frames[t] = cv2.resize(scene.frame(t), (width, height), interpolation=cv2.INTER_AREA)
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
        write_video(out_dir / rel, render_clip(np.random.default_rng([seed, i]), n_frames, height, width), fps)
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
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, help="folder for the clips and annotations_{train,val}.json")
    parser.add_argument("--num_clips", type=int, default=32, help="clips to render (default: 32)")
    parser.add_argument("--frames", type=int, default=24, help="frames per clip (default: 24)")
    parser.add_argument("--height", type=int, default=96, help="frame height (default: 96)")
    parser.add_argument("--width", type=int, default=144, help="frame width (default: 144)")
    parser.add_argument("--seed", type=int, default=0, help="the same seed renders the same scenes")
    parser.add_argument("--val_fraction", type=float, default=0.125, help="share of clips held out (default: 0.125)")
    parser.add_argument("--fps", type=float, default=24.0, help="frame rate written into the files (default: 24)")
    args = parser.parse_args(argv)
    paths = make_demo_dataset(
        args.out_dir, args.num_clips, args.frames, args.height, args.width, args.seed, args.val_fraction, args.fps
    )
    print(f"wrote {args.num_clips} clips to {args.out_dir / 'videos'}")
    print(f"train: {paths['train']}\nval:   {paths['val']}")
    print(f"train with data_root={args.out_dir} annotation_file={paths['train']}")


if __name__ == "__main__":
    main()
