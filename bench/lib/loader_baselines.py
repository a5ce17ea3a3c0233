"""What bench/bench_data.py holds the loader against: OpenCV's ``INTER_AREA`` next to the
loader's ``area_resize`` on loader-like crops, and raw OpenCV decoding, of files from the
start or of exactly the windows the loader reads, alone or in N processes at once.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

import cv2
import numpy as np

from bench.lib.harness import timed
from taehv_train.common.clips import VideoClipDataset
from taehv_train.common.video.crop import crop_box
from taehv_train.common.video.reader import VideoReader
from taehv_train.common.video.resize import area_resize
from taehv_train.training.data.clip_loader import build_dataloader

Window = tuple[str, int, int, int]  # path, start, stride, count


def sample_crops(paths: list[str], width: int, height: int, crop_scale: tuple[float, float]) -> list[np.ndarray]:
    """Four loader-like crops (area fraction, position) of frames 0, 10 and 20 of each file."""
    rng = np.random.default_rng(0)
    crops = []
    for path in paths:
        with VideoReader(path) as reader:
            frames, _ = reader.read(0, 10, 3)
        for frame in frames:
            for _ in range(4):
                area, u_y, u_x = float(rng.uniform(*crop_scale)), float(rng.random()), float(rng.random())
                y, x, h, w = crop_box(frame.shape[0], frame.shape[1], height, width, area, u_y, u_x)
                crops.append(frame[y : y + h, x : x + w])
    return crops


@contextmanager
def one_opencv_thread() -> Iterator[None]:
    """One core's worth of OpenCV (as in a forked DataLoader worker)."""
    threads = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        yield
    finally:
        cv2.setNumThreads(threads)


def inter_area(crop: np.ndarray, width: int, height: int) -> np.ndarray:
    return cv2.resize(crop, (width, height), interpolation=cv2.INTER_AREA)


def resize_cost(crops: list[np.ndarray], width: int, height: int, repeats: int = 9) -> dict:
    """ms per frame (one OpenCV thread) of INTER_AREA and area_resize, interleaved per crop."""
    resizers = {"inter_area": inter_area, "area_resize": area_resize}
    seconds: dict[str, list[float]] = {name: [] for name in resizers}
    with one_opencv_thread():
        for repeat in range(repeats):
            order = list(resizers) if repeat % 2 == 0 else list(resizers)[::-1]
            total = dict.fromkeys(resizers, 0.0)
            for crop in crops:
                for name in order:
                    total[name] += timed(functools.partial(resizers[name], crop, width, height))[0]
            for name in resizers:
                seconds[name].append(total[name] / len(crops))
    diff = np.concatenate(
        [np.abs(area_resize(c, width, height).astype(np.int16) - inter_area(c, width, height)).ravel() for c in crops]
    )
    ms = {name: float(np.median(v)) * 1e3 for name, v in seconds.items()}
    return {
        "size": f"{width}x{height}",
        "crops": len(crops),
        "inter_area_ms": round(ms["inter_area"], 3),
        "area_resize_ms": round(ms["area_resize"], 3),
        "speed_up": round(ms["inter_area"] / ms["area_resize"], 2),
        "mean_abs_diff": round(float(diff.mean()), 3),
        "max_abs_diff": int(diff.max()),
    }


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


@contextmanager
def recorded_reads(windows: list[Window]) -> Iterator[None]:
    """Append the (path, start, stride, count) of every VideoReader.read to ``windows``."""
    read = VideoReader.read

    def recording(self: VideoReader, start: int, stride: int, count: int, transform=None):
        windows.append((self.path, start, stride, count))
        return read(self, start, stride, count, transform)

    VideoReader.read = recording
    try:
        yield
    finally:
        VideoReader.read = read


def loader_windows(dataset: VideoClipDataset) -> list[Window]:
    """The windows the timed samples (1..len-1) read: they depend only on (seed, epoch, index)."""
    windows: list[Window] = []
    with recorded_reads(windows):
        for i in range(1, len(dataset)):
            dataset[i]
    return windows


def raw_decode_windows(windows: list[Window]) -> float:
    """Frames per second decoding exactly these windows as the loader does, minus its transform."""
    frames = 0
    start = time.perf_counter()
    for path, first, stride, count in windows:
        with VideoReader(path) as reader:
            frames += len(reader.read(first, stride, count)[0])
    return frames / (time.perf_counter() - start)


_start_together: mp.synchronize.Barrier | None = None  # set in raw-decode processes


def _join_barrier(barrier: mp.synchronize.Barrier) -> None:
    global _start_together
    _start_together = barrier


def _decode_share(windows: list[Window]) -> float:
    _start_together.wait()
    return raw_decode_windows(windows)


def raw_decode_per_process(windows: list[Window], processes: int) -> float:
    """Frames per second per process when ``processes`` processes decode their shares at once.

    The raw rate one of N DataLoader workers could reach: they share cores, caches and
    memory bandwidth (and here only 2 cores). Fresh (spawned) processes, started together.
    """
    if processes <= 1:
        return raw_decode_windows(windows)
    context = mp.get_context("spawn")
    barrier = context.Barrier(processes)
    with ProcessPoolExecutor(processes, mp_context=context, initializer=_join_barrier, initargs=(barrier,)) as pool:
        rates = list(pool.map(_decode_share, [windows[i::processes] for i in range(processes)]))
    return float(np.mean(rates))


def loader_rate(dataset: VideoClipDataset, workers: int) -> float:
    """Frames per second of samples 1..len-1 (sample 0 warms up: imports, first open, workers)."""
    if workers == 0:
        with one_opencv_thread():
            dataset[0]
            start = time.perf_counter()
            frames = sum(dataset[i]["frames"].shape[0] for i in range(1, len(dataset)))
    else:
        loader = build_dataloader(dataset, batch_size=1, num_workers=workers, shuffle=False, drop_last=False)
        batches = iter(loader)
        next(batches)
        start = time.perf_counter()
        frames = sum(b["frames"].shape[1] for b in batches)
    return frames / (time.perf_counter() - start)
