#!/usr/bin/env python3
"""Data loader throughput next to raw OpenCV decoding of the same files; prints JSON.

    python -m bench.bench_data --videos_dir ../shared/videos --sizes 720x480 256x256 \\
        --clips 48 --workers 0 1 2
    python -m bench.bench_data --videos_dir ../shared/videos --sizes 720x480 256x256 \\
        --clips 48 --decoders_only --decoders pyav torchcodec

Clip length, stride range and crop scale default to the training defaults
(``common/config.py``: 17 frames, stride 1-3, crop area 0.6-1.0); ``--n_frames 12
--stride_range 1 1`` is the hardest case for the ratios (no skipped frames, so the
least decoding per output frame).

Resize: per-frame cost with one OpenCV thread of a single ``cv2.INTER_AREA`` and of the
loader's ``area_resize`` on loader-like crops (crop scale drawn from ``--crop_scale``) of
real frames, timed interleaved crop by crop (median over repeats), and how far apart the
two outputs are (mean and max absolute difference in 8-bit levels).
Raw decode: open each file and read ``n_frames`` consecutive frames from the start with
``cv2.VideoCapture.read`` (decode + BGR conversion, one FFmpeg thread, as the loader).
Raw decode of the loader's windows: the same files, starts and strides that the loader
reads in a row (recorded from a dry pass; seeking as the loader does), i.e. the decoding
cost of the loader's access pattern without its crop/resize/tensor work. For N >= 2
workers it runs in N processes at once, each decoding its share (as the workers do), so
that both sides of the per-worker ratio get the same share of the machine.
Loader: ``VideoClipDataset`` samples of ``n_frames`` frames (random crop, area resize to
WxH, flip, RGB tensor) in two windows:
- "random": the training sampler (start uniform over the decodable frames, stride in
  ``--stride_range``): includes the cost of random access (a seek decodes from the
  keyframe before the start);
- "first": the annotation claims each clip has exactly ``n_frames`` frames, so the
  window starts at frame 0 like the raw read: isolates the loader's own overhead.
Workers 0 is the dataset called in this process with one OpenCV thread (a worker's
share: forked DataLoader workers resize single-threaded too), otherwise
``build_dataloader`` with batch size 1; both time samples 1..clips (sample 0 is the
warm-up: imports, first open, worker start-up). "per worker" divides by max(workers, 1).
Clips cycle through the files. Each loader row is the median of ``--repeats`` rounds,
each round a raw decode of the row's windows right before the loader pass, so that both
see the same machine load.
Ratios: ``vs_raw_sequential`` against the sequential raw read, ``vs_raw_same_starts``
the median of the rounds' loader / raw-of-the-same-windows ratios.
Decoders (``--decoders opencv pyav torchcodec``): the loader's recorded windows (files,
frame indices, each sample's crop) decoded by each library in this process with one
thread, and its frames checked against OpenCV's. Per decoder, frames/s of decoding plus
conversion to uint8 HWC at source resolution (``source``), and of that plus the loader's
per-frame writer (crop, area resize, flip, RGB planes; the same for every decoder) for
each ``--sizes`` output. Decoders take turns read by read (same machine load); medians
over ``--repeats`` rounds, ``vs_opencv`` the median of the rounds' ratios. Each library
seeks as it does best: OpenCV as the loader (``VideoReader``); PyAV seeks to the keyframe
before a window's first frame when the jump is at least the loader's seek threshold and
decodes forward (frame index from the pts); torchcodec
``VideoDecoder(seek_mode="exact" | "approximate").get_frames_at(indices)`` in NHWC.
Equality: mean and max absolute difference to OpenCV's frame at the same index, and how
many frames are closer to OpenCV's previous or next frame (off by one). A decoder that
cannot be imported is listed under ``unavailable`` with the reason.
``--decoders_only`` skips everything else.
Time split: for each window and size, the shares of a sample's time (in this process,
one OpenCV thread) spent seeking, in the per-frame writer (crop, resize, flip, RGB
planes) and in the rest (open, decode, sampling). Worker transfer: ms per sample to hand
a ready sample of the loader's shape from one worker to the main process.
"""

from __future__ import annotations

import argparse
import functools
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import av
import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from bench.lib.harness import command_line, cpus_summary, print_json, shared_dir, timed
from bench.lib.loader_baselines import (
    Window,
    loader_rate,
    loader_windows,
    one_opencv_thread,
    raw_decode,
    raw_decode_per_process,
    resize_cost,
    sample_crops,
)
from taehv_train.base.flags import ArgumentParser
from taehv_train.common.clips import VideoClipDataset
from taehv_train.common.config import TrainConfig
from taehv_train.common.video.crop import ClipWriter
from taehv_train.common.video.files import find_videos
from taehv_train.common.video.probe import probe_video
from taehv_train.common.video.reader import VideoReader
from taehv_train.training.annotate.annotation_files import write_annotation


def time_split(dataset: VideoClipDataset) -> dict:
    """Where a sample's time goes, in this process with one OpenCV thread.

    ``seek`` is ``VideoReader.seek`` (decoding from the keyframe before the target),
    ``writer`` the per-frame crop, area resize, flip and RGB planes (``ClipWriter``), and
    ``rest`` everything else: opening the file, decoding the frames read, sampling.
    """
    totals = {"seek": 0.0, "writer": 0.0}
    targets = {"seek": (VideoReader, "seek"), "writer": (ClipWriter, "__call__")}
    originals = {name: getattr(owner, attr) for name, (owner, attr) in targets.items()}

    def timed(name: str):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return originals[name](*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start

        return call

    for name, (owner, attr) in targets.items():
        setattr(owner, attr, timed(name))
    try:
        with one_opencv_thread():
            dataset[0]
            totals.update(seek=0.0, writer=0.0)
            start = time.perf_counter()
            for i in range(1, len(dataset)):
                dataset[i]
            total = time.perf_counter() - start
    finally:
        for name, (owner, attr) in targets.items():
            setattr(owner, attr, originals[name])
    return {
        "ms_per_sample": round(total / (len(dataset) - 1) * 1e3, 1),
        "seek_share": round(totals["seek"] / total, 3),
        "writer_share": round(totals["writer"] / total, 3),
        "rest_share": round(1 - (totals["seek"] + totals["writer"]) / total, 3),
    }


class _FixedSample(Dataset):
    """Samples of the loader's shape with no decoding: what is left is the hand-over."""

    def __init__(self, shape: tuple[int, ...], length: int):
        self.frames, self.length = torch.zeros(shape, dtype=torch.uint8), length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        return {"frames": self.frames, "index": index, "failures": 0}


def worker_transfer(shape: tuple[int, ...], samples: int = 24) -> dict:
    """ms per sample to hand a sample from one DataLoader worker to the main process.

    The worker's collate copies it into fresh shared memory; the main process maps it.
    """
    batches = iter(DataLoader(_FixedSample(shape, samples + 1), batch_size=1, num_workers=1))
    next(batches)
    start = time.perf_counter()
    for _ in batches:
        pass
    return {
        "mb_per_sample": round(math.prod(shape) / 1e6, 1),
        "ms_per_sample": round((time.perf_counter() - start) / samples * 1e3, 2),
    }


# ----------------------------------------------------------------------------------------
# Decoder comparison
# ----------------------------------------------------------------------------------------

DECODER_CHOICES = ("opencv", "pyav", "torchcodec", "torchcodec_exact", "torchcodec_approximate")


@dataclass(frozen=True)
class Request:
    """One window the loader read: the frames that decoded, and the sample's crop."""

    path: str
    start: int
    stride: int
    count: int  # frames the loader got from this read (fewer than asked where the stream ends)
    crop: tuple[float, float, float, bool]  # area, u_y, u_x, flip of the sample's ClipWriter

    @property
    def indices(self) -> list[int]:
        return list(range(self.start, self.start + self.count * self.stride, self.stride))


FrameSource = Callable[[Request], Iterator[np.ndarray]]  # uint8 HWC frames at the request's indices


@dataclass(frozen=True)
class Decoder:
    name: str
    frames: FrameSource
    rgb: bool  # channel order of the frames: RGB, else BGR


def loader_requests(dataset: VideoClipDataset) -> list[Request]:
    """The reads of the timed samples (1..len-1) with their crops: a pure function of (seed, epoch, index)."""
    requests: list[Request] = []
    read = VideoReader.read

    def recording(self: VideoReader, start: int, stride: int, count: int, transform=None):
        frames, decoded = read(self, start, stride, count, transform)
        if frames:
            crop = (transform.area, transform.u_y, transform.u_x, transform.flip)
            requests.append(Request(self.path, start, stride, len(frames), crop))
        return frames, decoded

    VideoReader.read = recording
    try:
        for i in range(1, len(dataset)):
            dataset[i]
    finally:
        VideoReader.read = read
    return requests


def opencv_frames(request: Request, seek_threshold: int = 32) -> Iterator[np.ndarray]:
    """BGR frames read as the loader reads them (``VideoReader``: grab to skip, seek for long jumps)."""
    with VideoReader(request.path, seek_threshold=seek_threshold) as reader:
        for index in request.indices:
            frames, _ = reader.read(index, 1, 1)
            if not frames:
                raise RuntimeError(f"{request.path}: OpenCV decoded no frame {index}")
            yield frames[0]


def pyav_frames(request: Request, seek_threshold: int = 32) -> Iterator[np.ndarray]:
    """BGR frames from PyAV, one decoding thread.

    A jump of at least ``seek_threshold`` frames (the loader's rule) seeks to the keyframe
    before the target and decodes forward; a frame's index is its pts less the stream's
    start, in frame durations. Where the seek lands after the target (a keyframe whose
    decoding timestamp precedes the target but whose pts follows it), it seeks again
    further back. Frames before a wanted one are decoded but not converted.
    """
    with av.open(request.path) as container:
        stream = container.streams.best("video")
        stream.codec_context.thread_count = 1
        origin = stream.start_time or 0
        frames_per_tick = float(stream.time_base * stream.average_rate)
        decoded = container.decode(stream)
        position = 0  # index of the next frame ``decoded`` gives (about, after a seek)
        for index in request.indices:
            back = 0
            while True:
                if index - position >= seek_threshold or back:
                    target = max(index - back, 0)
                    container.seek(origin + round(target / frames_per_tick), stream=stream, backward=True)
                    decoded = container.decode(stream)
                    position = target
                frame = next(decoded, None)
                while frame is not None and (found := round((frame.pts - origin) * frames_per_tick)) < index:
                    frame = next(decoded, None)
                if frame is None:
                    raise RuntimeError(f"{request.path}: PyAV's stream ended before frame {index}")
                position = found + 1
                if found == index:
                    break
                if back > index:
                    raise RuntimeError(f"{request.path}: PyAV gives frame {found} where frame {index} should be")
                back = 2 * back + 1  # the seek landed after the target: aim earlier
            yield frame.to_ndarray(format="bgr24")


def torchcodec_frames(seek_mode: str) -> FrameSource:
    """RGB frames from ``torchcodec``'s ``VideoDecoder.get_frames_at`` (NHWC, one FFmpeg thread)."""
    from torchcodec.decoders import VideoDecoder

    def frames(request: Request) -> Iterator[np.ndarray]:
        decoder = VideoDecoder(
            request.path, seek_mode=seek_mode, num_ffmpeg_threads=1, dimension_order="NHWC", device="cpu"
        )
        yield from decoder.get_frames_at(request.indices).data.numpy()

    return frames


def torchcodec_unavailable() -> str | None:
    """Why ``torchcodec`` cannot decode here (not installed, or its FFmpeg libraries not
    found), or None."""
    try:
        import torchcodec.decoders  # noqa: F401  loads libtorchcodec and the FFmpeg it links
    except (ImportError, OSError, RuntimeError) as err:
        return f"{type(err).__name__}: {' '.join(str(err).split())[:400]}"
    return None


def decoder_versions() -> dict[str, str]:
    versions = {
        "opencv": cv2.__version__,
        "pyav": f"{av.__version__} (libavcodec {'.'.join(map(str, av.library_versions['libavcodec']))})",
    }
    if torchcodec_unavailable() is None:
        import torchcodec

        versions["torchcodec"] = f"{torchcodec.__version__} (FFmpeg {torchcodec.ffmpeg_major_version})"
    return versions


def available_decoders(names: list[str], seek_threshold: int) -> tuple[list[Decoder], dict[str, str]]:
    """The decoders asked for (OpenCV always, first: it is the reference), and those that
    cannot run here with the reason."""
    wanted = ["opencv"]
    for name in names:
        for expanded in ("torchcodec_exact", "torchcodec_approximate") if name == "torchcodec" else (name,):
            if expanded not in wanted:
                wanted.append(expanded)
    decoders, unavailable = [], {}
    missing_torchcodec = torchcodec_unavailable() if any(n.startswith("torchcodec") for n in wanted) else None
    for name in wanted:
        if name == "opencv":
            decoders.append(Decoder(name, lambda r: opencv_frames(r, seek_threshold), rgb=False))
        elif name == "pyav":
            decoders.append(Decoder(name, lambda r: pyav_frames(r, seek_threshold), rgb=False))
        elif missing_torchcodec is not None:
            unavailable[name] = missing_torchcodec
        else:
            decoders.append(Decoder(name, torchcodec_frames(name.removeprefix("torchcodec_")), rgb=True))
    return decoders, unavailable


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread, as in a DataLoader worker."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def produce(decoder: Decoder, request: Request, n_frames: int, size: tuple[int, int] | None) -> int:
    """The request's frames from ``decoder``, through the loader's writer for a ``size``
    (WxH), else as decoded (uint8 HWC, source resolution); returns how many."""
    writer = None if size is None else ClipWriter(n_frames, size[1], size[0], *request.crop)
    frames = 0
    for k, frame in enumerate(decoder.frames(request)):
        if writer is not None:
            writer(frame, k)
        frames += 1
    return frames


def compare_to_opencv(decoder: Decoder, requests: list[Request]) -> dict:
    """Each frame of ``decoder`` against OpenCV's frames at the same index and at the
    indices either side: mean and max absolute difference (8-bit levels) to the same
    index, and how many frames are closer to a neighbour (a frame off by one)."""
    total_l1, pixels, max_diff, identical, off_by_one, frames, missing = 0.0, 0, 0, 0, 0, 0, 0
    for request in requests:
        first = max(request.start - 1, 0)
        span = request.indices[-1] + 2 - first
        with VideoReader(request.path) as reader:
            reference, _ = reader.read(first, 1, span)
        got = 0
        for index, frame in zip(request.indices, decoder.frames(request)):
            got += 1
            bgr = cv2.cvtColor(frame, cv2.COLOR_RGB2BGR) if decoder.rgb else frame
            same = reference[index - first]
            l1 = cv2.norm(bgr, same, cv2.NORM_L1)
            total_l1, pixels = total_l1 + l1, pixels + same.size
            max_diff = max(max_diff, int(cv2.norm(bgr, same, cv2.NORM_INF)))
            identical += l1 == 0
            neighbours = [reference[i - first] for i in (index - 1, index + 1) if first <= i < first + len(reference)]
            off_by_one += any(cv2.norm(bgr, n, cv2.NORM_L1) < l1 for n in neighbours)
        frames += got
        missing += request.count - got
    return {
        "decoder": decoder.name,
        "frames": frames,
        "missing_frames": missing,
        "mean_abs_diff": round(total_l1 / max(pixels, 1), 3),
        "max_abs_diff": max_diff,
        "identical_frames": int(identical),
        "closer_to_a_neighbour": int(off_by_one),
        "same_frames": missing == 0 and off_by_one == 0,
    }


def decoder_rows(
    decoders: list[Decoder], requests: list[Request], sizes: list[tuple[int, int]], n_frames: int, repeats: int
) -> list[dict]:
    """Frames/s of each decoder for the source frames and for each output size, one thread.

    Decoders take turns read by read (the order rotating), so that all of them see the
    same machine load, and a round's rate is a decoder's frames over its summed time;
    medians of ``repeats`` rounds, ``vs_opencv`` the median of the rounds' ratios.
    """
    outputs: list[tuple[int, int] | None] = [None, *sizes]
    rates: dict[tuple[str, int], list[float]] = {(d.name, o): [] for d in decoders for o in range(len(outputs))}
    with one_opencv_thread(), one_torch_thread():
        for decoder in decoders:  # warm-up: imports, first open
            produce(decoder, requests[0], n_frames, None)
        for repeat in range(repeats):
            for o, output in enumerate(outputs):
                seconds = dict.fromkeys((d.name for d in decoders), 0.0)
                frames = dict.fromkeys(seconds, 0)
                for i, request in enumerate(requests):
                    turn = (i + repeat) % len(decoders)
                    for decoder in decoders[turn:] + decoders[:turn]:
                        spent, count = timed(functools.partial(produce, decoder, request, n_frames, output))
                        frames[decoder.name] += count
                        seconds[decoder.name] += spent
                for name in seconds:
                    rates[name, o].append(frames[name] / seconds[name])
    rows = []
    for o, output in enumerate(outputs):
        for decoder in decoders:
            own, reference = rates[decoder.name, o], rates["opencv", o]
            rows.append(
                {
                    "decoder": decoder.name,
                    "output": "source" if output is None else f"{output[0]}x{output[1]}",
                    "frames_per_s_per_worker": round(float(np.median(own)), 1),
                    "vs_opencv": round(float(np.median([a / b for a, b in zip(own, reference)])), 2),
                    "rounds_frames_per_s": [round(r, 1) for r in own],
                }
            )
    return rows


def loader_row(dataset: VideoClipDataset, windows: list[Window], workers: int, repeats: int, sequential: float) -> dict:
    """Median over ``repeats`` rounds of (raw decode of the same windows, then the loader).

    Pairing each loader measurement with a raw one taken just before it keeps the ratio
    meaningful on a machine whose load changes during the run.
    """
    raw, loader = [], []
    for _ in range(repeats):
        raw.append(raw_decode_per_process(windows, workers))
        loader.append(loader_rate(dataset, workers))
    per = max(workers, 1)
    frames_per_s = float(np.median(loader))
    n_frames = dataset.n_frames
    return {
        "workers": workers,
        "clips_per_s": round(frames_per_s / n_frames, 2),
        "frames_per_s": round(frames_per_s, 1),
        "clips_per_s_per_worker": round(frames_per_s / n_frames / per, 2),
        "frames_per_s_per_worker": round(frames_per_s / per, 1),
        "raw_same_starts_frames_per_s_per_process": round(float(np.median(raw)), 1),
        "vs_raw_sequential": round(frames_per_s / per / sequential, 2),
        "vs_raw_same_starts": round(float(np.median([ld / per / rw for ld, rw in zip(loader, raw)])), 2),
    }


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--videos_dir", type=Path, default=shared_dir() / "videos")
    train = TrainConfig()
    parser.add_argument("--n_frames", type=int, default=train.n_frames)
    parser.add_argument("--sizes", nargs="+", default=[f"{train.width}x{train.height}", "256x256"], help="WxH outputs")
    parser.add_argument("--clips", type=int, default=48, help="samples per measurement")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--stride_range", type=int, nargs=2, default=[train.stride_min, train.stride_max])
    parser.add_argument("--crop_scale", type=float, nargs=2, default=[train.crop_scale_min, train.crop_scale_max])
    parser.add_argument("--repeats", type=int, default=3, help="rounds per loader and decoder row (medians)")
    parser.add_argument(
        "--decoders",
        nargs="*",
        choices=DECODER_CHOICES,
        default=[],
        help="compare these decoders with OpenCV on the loader's windows (torchcodec: both seek modes)",
    )
    parser.add_argument(
        "--decoder_windows", nargs="+", choices=("random", "first"), default=["random", "first"], help="for --decoders"
    )
    parser.add_argument("--decoders_only", action="store_true", help="only the decoder comparison")
    args = parser.parse_args()

    rel_paths = find_videos(args.videos_dir)
    paths = [str(args.videos_dir / p) for p in rel_paths]
    entries = [{"path": p, "frames": probe_video(args.videos_dir / p).frames} for p in rel_paths]
    sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes]
    result = {
        "machine": cpus_summary(),
        "cpu_threads_opencv": cv2.getNumThreads(),
        "command": command_line(),
        "videos": len(paths),
        "n_frames": args.n_frames,
        "stride_range": args.stride_range,
        "crop_scale": args.crop_scale,
        "clips": args.clips,
        "repeats": args.repeats,
    }
    if not args.decoders_only:
        result |= {
            "resize": [resize_cost(sample_crops(paths, w, h, tuple(args.crop_scale)), w, h) for w, h in sizes],
            "raw_decode": raw_decode(paths, args.clips, args.n_frames),
            "worker_transfer": [{"size": f"{w}x{h}", **worker_transfer((args.n_frames, 3, h, w))} for w, h in sizes],
            "time_split": [],
            "loader": [],
        }
    with tempfile.TemporaryDirectory() as tmp:

        def dataset_for(window: str, width: int, height: int) -> VideoClipDataset:
            # Repeat the clip list so that one epoch holds --clips samples (+1 warm-up).
            annotation = Path(tmp) / f"{window}.json"
            clips = [entries[i % len(entries)] for i in range(args.clips + 1)]
            if window == "first":
                clips = [{**e, "frames": args.n_frames} for e in clips]
            write_annotation(annotation, clips)
            return VideoClipDataset(
                args.videos_dir,
                annotation,
                n_frames=args.n_frames,
                height=height,
                width=width,
                stride_range=tuple(args.stride_range),
                crop_scale=tuple(args.crop_scale),
            )

        for window in () if args.decoders_only else ("random", "first"):
            for width, height in sizes:
                dataset = dataset_for(window, width, height)
                windows = loader_windows(dataset)
                result["time_split"].append({"window": window, "size": f"{width}x{height}", **time_split(dataset)})
                for workers in args.workers:
                    row = loader_row(dataset, windows, workers, args.repeats, result["raw_decode"]["frames_per_s"])
                    result["loader"].append({"window": window, "size": f"{width}x{height}", **row})
        if args.decoders or args.decoders_only:
            seek_threshold = dataset_for("random", *sizes[0]).seek_threshold
            decoders, unavailable = available_decoders(args.decoders, seek_threshold)
            comparison: dict = {
                "versions": decoder_versions(),
                "unavailable": unavailable,
                "threads": 1,
                "seek_threshold": seek_threshold,
                "windows": [],
                "equality": [],
                "rows": [],
            }
            for window in args.decoder_windows:
                # The windows and crops do not depend on the output size.
                requests = loader_requests(dataset_for(window, *sizes[0]))
                comparison["windows"].append(
                    {"window": window, "reads": len(requests), "frames": sum(r.count for r in requests)}
                )
                for decoder in decoders:
                    comparison["equality"].append({"window": window, **compare_to_opencv(decoder, requests)})
                for row in decoder_rows(decoders, requests, sizes, args.n_frames, args.repeats):
                    comparison["rows"].append({"window": window, **row})
            result["decoders"] = comparison
    print_json(result)


if __name__ == "__main__":
    main()
