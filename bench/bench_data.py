#!/usr/bin/env python3
"""Data loader throughput next to raw OpenCV decoding of the same files; prints JSON.

    python bench/bench_data.py --videos-dir ../shared/videos --n-frames 12 \\
        --sizes 720x480 256x256 --clips 48 --workers 0 1 2

Raw decode: open each file and read ``n_frames`` consecutive frames from the start with
``cv2.VideoCapture.read`` (decode + BGR conversion, one FFmpeg thread, as the loader).
Raw decode at random starts: the same, from a uniformly drawn start (seeking as the
loader does), i.e. the decoding cost of the loader's access pattern without its
crop/resize/tensor work.
Loader: ``VideoClipDataset`` samples of ``n_frames`` frames (random crop, INTER_AREA
resize to WxH, flip, RGB tensor) in two windows:
- "random": the training sampler (start uniform over the decodable frames, stride in
  ``--stride-range``): includes the cost of random access (a seek decodes from the
  keyframe before the start);
- "first": the annotation claims each clip has exactly ``n_frames`` frames, so the
  window starts at frame 0 like the raw read: isolates the loader's own overhead.
Workers 0 is the dataset called in this process, otherwise ``build_dataloader`` with
batch size 1 (clock started after the first batch, so worker start-up is not counted).
"per worker" divides by max(workers, 1). Clips cycle through the files. Ratios:
``vs_raw_sequential`` against the sequential raw read, ``vs_raw_same_starts`` against
the raw read with the window's access pattern (random starts or frame 0).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.dataset import (  # noqa: E402
    VideoClipDataset,
    VideoReader,
    build_dataloader,
    find_videos,
    probe_video,
)
from training.make_annotations import write_annotation  # noqa: E402


def raw_decode(paths: list[str], n_clips: int, n_frames: int) -> dict:
    frames = 0
    start = time.perf_counter()
    for i in range(n_clips):
        cap = cv2.VideoCapture(paths[i % len(paths)], cv2.CAP_FFMPEG, [cv2.CAP_PROP_N_THREADS, 1])
        for _ in range(n_frames):
            ok, _frame = cap.read()
            if not ok:
                break
            frames += 1
        cap.release()
    seconds = time.perf_counter() - start
    return {"clips_per_s": round(n_clips / seconds, 2), "frames_per_s": round(frames / seconds, 1)}


def raw_decode_random_start(paths: list[str], lengths: list[int], n_clips: int, n_frames: int) -> dict:
    rng = np.random.default_rng(0)
    frames = 0
    start = time.perf_counter()
    for i in range(n_clips):
        first = int(rng.integers(lengths[i % len(paths)] - n_frames + 1))
        with VideoReader(paths[i % len(paths)]) as reader:
            frames += len(reader.read(first, 1, n_frames)[0])
    seconds = time.perf_counter() - start
    return {"clips_per_s": round(n_clips / seconds, 2), "frames_per_s": round(frames / seconds, 1)}


def loader_rate(dataset: VideoClipDataset, n_clips: int, workers: int) -> dict:
    if workers == 0:
        dataset[0]  # warm-up (imports, first open)
        start = time.perf_counter()
        frames = sum(dataset[i % len(dataset)]["frames"].shape[0] for i in range(n_clips))
    else:
        loader = build_dataloader(dataset, batch_size=1, num_workers=workers, shuffle=False, drop_last=False)
        batches = iter(loader)
        next(batches)
        start = time.perf_counter()
        frames = sum(b["frames"].shape[1] for b in batches)
        n_clips = len(dataset) - 1
    seconds = time.perf_counter() - start
    per = max(workers, 1)
    return {
        "workers": workers,
        "clips_per_s": round(n_clips / seconds, 2),
        "frames_per_s": round(frames / seconds, 1),
        "clips_per_s_per_worker": round(n_clips / seconds / per, 2),
        "frames_per_s_per_worker": round(frames / seconds / per, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_dir = Path(__file__).resolve().parents[2] / "shared" / "videos"
    parser.add_argument("--videos-dir", type=Path, default=default_dir)
    parser.add_argument("--n-frames", type=int, default=12)
    parser.add_argument("--sizes", nargs="+", default=["720x480", "256x256"], help="WxH outputs")
    parser.add_argument("--clips", type=int, default=48, help="samples per measurement")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--stride-range", type=int, nargs=2, default=[1, 1])
    parser.add_argument("--crop-scale", type=float, nargs=2, default=[0.5, 1.0])
    args = parser.parse_args()

    rel_paths = find_videos(args.videos_dir)
    paths = [str(args.videos_dir / p) for p in rel_paths]
    entries = [{"path": p, "frames": probe_video(args.videos_dir / p).frames} for p in rel_paths]
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "cpu_threads_opencv": cv2.getNumThreads(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "videos": len(paths),
        "n_frames": args.n_frames,
        "stride_range": args.stride_range,
        "clips": args.clips,
        "raw_decode": raw_decode(paths, args.clips, args.n_frames),
        "raw_decode_random_start": raw_decode_random_start(
            paths, [e["frames"] for e in entries], args.clips, args.n_frames
        ),
        "loader": [],
    }
    # Raw rate with the same access pattern as each loader window.
    baseline = {"random": result["raw_decode_random_start"], "first": result["raw_decode"]}
    with tempfile.TemporaryDirectory() as tmp:
        for window in ("random", "first"):
            # Repeat the clip list so that one epoch holds --clips samples (+1 warm-up).
            annotation = Path(tmp) / f"{window}.json"
            clips = [entries[i % len(entries)] for i in range(args.clips + 1)]
            if window == "first":
                clips = [{**e, "frames": args.n_frames} for e in clips]
            write_annotation(annotation, clips)
            for size in args.sizes:
                width, height = (int(v) for v in size.split("x"))
                dataset = VideoClipDataset(
                    args.videos_dir,
                    annotation,
                    n_frames=args.n_frames,
                    height=height,
                    width=width,
                    stride_range=tuple(args.stride_range),
                    crop_scale=tuple(args.crop_scale),
                )
                for workers in args.workers:
                    rate = loader_rate(dataset, args.clips, workers)
                    per_worker = rate["frames_per_s_per_worker"]
                    rate["vs_raw_sequential"] = round(per_worker / result["raw_decode"]["frames_per_s"], 2)
                    rate["vs_raw_same_starts"] = round(per_worker / baseline[window]["frames_per_s"], 2)
                    result["loader"].append({"window": window, "size": size, **rate})
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
