"""Video data pipeline: shapes, sampling, decoding, bad files, determinism, DataLoader."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import multiprocessing
import os
import signal
import struct
import sys
import threading
import traceback
import zlib
from collections.abc import Iterator
from pathlib import Path

import av
import cv2
import numpy as np
import pytest
import torch
from accelerate.data_loader import DataLoaderShard

from taehv_train.common.clip_table import ClipTable
from taehv_train.common.clips import VideoClipDataset, VideoDataError, fit_stride
from taehv_train.common.video.crop import ClipWriter, crop_box
from taehv_train.common.video.files import BadClipError, find_videos
from taehv_train.common.video.probe import probe_video
from taehv_train.common.video.reader import VideoReader
from taehv_train.common.video.resize import AreaResizer, area_resize
from taehv_train.training.annotate.annotation_files import write_annotation
from taehv_train.training.data.clip_loader import EpochShuffleSampler, build_dataloader, tie_worker_to_parent
from taehv_train.training.data.loading import batches_until_data_error
from taehv_train.training.demo_data import make_demo_dataset

SHADOW = "udacity_alf_project_video_shadow_160f.mp4"  # container says 162, 160 decode
START = "udacity_alf_project_video_start_200f.mp4"  # audio is stream 0, moov at the end
VEHDET = "udacity_vehdet_test_video.mp4"  # 38 frames
GOPRO = "gopro_max_heromode.mp4"  # full-range yuvj420p, 848x480
DOG = "sam2_01_dog.mp4"  # moov at the start: a truncated copy still opens


# ---------------------------------------------------------------------------- helpers


def write_index_video(path: Path, n_frames: int, height: int = 48, width: int = 64) -> Path:
    """Flat grey frames whose brightness encodes the frame index (survives crop/resize/flip)."""
    assert n_frames <= 30
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 25, (width, height))
    for i in range(n_frames):
        writer.write(np.full((height, width, 3), 12 + 8 * i, np.uint8))
    writer.release()
    return path


def frame_indices(frames: torch.Tensor) -> list[int]:
    """Decode the indices written by write_index_video (mp4v shifts levels by ~3)."""
    codes = (frames.float().mean(dim=(1, 2, 3)).numpy() - 9) / 8
    assert np.abs(codes - codes.round()).max() < 0.3, codes
    return codes.round().astype(int).tolist()


def annotate(path: Path, entries: list[dict]) -> Path:
    write_annotation(path, entries)
    return path


def write_huge_header_png(path: Path) -> Path:
    """A 2x2 PNG whose header (IHDR, CRC fixed) claims 100000x100000 pixels."""
    cv2.imwrite(str(path), np.zeros((2, 2, 3), np.uint8))
    data = bytearray(path.read_bytes())
    data[16:24] = struct.pack(">II", 100_000, 100_000)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    path.write_bytes(bytes(data))
    return path


def write_audio_only_mp4(path: Path) -> Path:
    """An MP4 with one short AAC stream and no video stream."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=8000)
        for i in range(3):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 8000, i * 1024
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


@contextlib.contextmanager
def fifos(*paths: Path, seconds: float = 20) -> Iterator[list[Path]]:
    """FIFOs at ``paths``. Code that opened one for reading would wait for a writer forever:
    every ``seconds`` a writer opens and closes each, so such code fails instead of hanging."""
    for path in paths:
        os.mkfifo(path)
    stop = threading.Event()

    def unblock_readers() -> None:
        while not stop.wait(seconds):
            for path in paths:
                os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))  # never blocks, wakes a waiting reader

    thread = threading.Thread(target=unblock_readers, daemon=True)
    thread.start()
    try:
        yield list(paths)
    finally:
        stop.set()
        thread.join()


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("index_videos")
    write_index_video(root / "long.mp4", 30)
    write_index_video(root / "short.mp4", 12)
    for i in range(6):
        write_index_video(root / f"clip{i}.mp4", 24)
    return root


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("demo")
    make_demo_dataset(root, num_clips=4, n_frames=16, height=48, width=64, seed=1)
    return root


def annotate_one_clip_many_times(path: Path, entry: dict, count: int) -> Path:
    """The file ``annotate(path, [entry] * count)`` writes, built from one encoded line."""
    line = json.dumps(entry, ensure_ascii=False)
    path.write_text(f'{{"total": {count}, "list": [\n' + ",\n".join([line] * count) + "\n]}\n", encoding="utf-8")
    return path


def index_dataset(root: Path, tmp_path: Path, entries: list[dict], **kwargs) -> VideoClipDataset:
    ann = annotate(tmp_path / "ann.json", entries)
    defaults = dict(n_frames=4, height=16, width=24, stride_range=(1, 3), crop_scale=(0.5, 1.0))
    return VideoClipDataset(root, ann, **{**defaults, **kwargs})


# ------------------------------------------------------------------- shapes and colour


@pytest.mark.parametrize("height,width", [(480, 720), (64, 96)])
def test_real_clips_give_exact_non_square_shapes(videos_dir, tmp_path, height, width):
    ann = annotate(tmp_path / "ann.json", [{"path": VEHDET, "frames": 38}, {"path": GOPRO, "frames": 315}])
    ds = VideoClipDataset(videos_dir, ann, n_frames=5, height=height, width=width, stride_range=(1, 2))
    for i in range(len(ds)):
        sample = ds[i]
        assert sample["frames"].dtype == torch.uint8
        assert sample["frames"].shape == (5, 3, height, width)
        assert sample["frames"].is_contiguous()
        assert sample["index"] == i and sample["failures"] == 0


def test_directory_source_scans_recursively(videos_dir):
    ds = VideoClipDataset(videos_dir, n_frames=2, height=8, width=8)
    assert len(ds) == 6
    assert {Path(ds.clips.path(i)).name for i in range(len(ds))} >= {SHADOW, GOPRO}
    assert (ds.clips.frames == -1).all()  # unknown: read from the container at load time


def test_output_is_rgb(tmp_path):
    path = tmp_path / "red.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 25, (64, 48))
    for _ in range(4):
        writer.write(np.full((48, 64, 3), (30, 90, 220), np.uint8))  # BGR: mostly red
    writer.release()
    frames = VideoClipDataset(tmp_path, n_frames=2, height=16, width=16, stride_range=(1, 1))[0]["frames"]
    red, green, blue = frames.float().mean(dim=(0, 2, 3)).tolist()
    assert red > 180 and blue < 60 and 60 < green < 120


def write_rgba(path: Path, height: int = 48, width: int = 64) -> np.ndarray:
    """An RGBA PNG: red on the left, blue on the right, alpha ramping 0 -> 255 down the rows."""
    rgba = np.zeros((height, width, 4), np.uint8)
    rgba[:, : width // 2, 0], rgba[:, width // 2 :, 2] = 220, 200
    rgba[..., 3] = np.linspace(0, 255, height).astype(np.uint8)[:, None]
    cv2.imwrite(str(path), cv2.cvtColor(rgba, cv2.COLOR_RGBA2BGRA))
    return rgba


def test_rgba_images_are_one_frame_clips_with_their_alpha(tmp_path):
    """channels=4: a PNG keeps its alpha through the crop and resize (and the flip), a video
    is opaque; channels=3 drops the alpha; a still image gives no two-frame clip; a folder
    scan takes images for RGB and RGBA alike."""
    (tmp_path / "images").mkdir(), (tmp_path / "videos").mkdir()
    rgba = write_rgba(tmp_path / "images" / "ramp.png")
    write_index_video(tmp_path / "videos" / "clip.mp4", 4)
    annotation = annotate(
        tmp_path / "all.json", [{"path": "images/ramp.png", "frames": 1}, {"path": "videos/clip.mp4", "frames": 4}]
    )
    val = VideoClipDataset(tmp_path, annotation, n_frames=1, height=24, width=32, mode="val", channels=4)
    image, video = val[0]["frames"], val[1]["frames"]
    assert image.shape == video.shape == (1, 4, 24, 32) and image.dtype == torch.uint8
    expected = area_resize(rgba, 32, 24)  # the full frame: same aspect, val crops nothing
    assert np.abs(image[0].permute(1, 2, 0).numpy().astype(int) - expected.astype(int)).max() <= 1
    assert (video[0, 3] == 255).all()  # a video has no alpha: opaque
    train = VideoClipDataset(tmp_path, annotation, n_frames=1, height=24, width=32, crop_scale=(1, 1), channels=4)
    drawn = []
    for epoch in range(8):
        train.set_epoch(epoch)
        drawn.append(train[0]["frames"])
    assert any(torch.equal(x, image) for x in drawn) and any(torch.equal(x, image.flip(-1)) for x in drawn)
    rgb = VideoClipDataset(tmp_path, annotation, n_frames=1, height=24, width=32, mode="val")[0]["frames"]
    assert torch.equal(rgb, image[:, :3])
    unknown = annotate(tmp_path / "unknown.json", [{"path": "images/ramp.png"}])  # no count: the reader's 1
    with pytest.raises(BadClipError, match="too short"):
        VideoClipDataset(tmp_path, unknown, n_frames=2, height=24, width=32, mode="val", channels=4).load_clip(0)
    assert len(VideoClipDataset(tmp_path, n_frames=1, height=8, width=8, channels=4)) == 2
    assert len(VideoClipDataset(tmp_path, n_frames=1, height=8, width=8)) == 2  # RGB too
    assert probe_video(tmp_path / "images" / "ramp.png").frames == 1


@pytest.mark.skipif(not hasattr(cv2, "imreadanimation"), reason="OpenCV < 4.11 reads an animation's first frame")
@pytest.mark.parametrize("name", ["anim.webp", "anim.png"])
def test_an_animated_image_is_a_clip_of_all_its_frames(tmp_path, name):
    """An animated WebP or PNG (APNG) gives all its frames, at the rate of their durations."""
    animation = cv2.Animation()
    animation.frames = [np.full((16, 24, 3), 20 + 40 * i, np.uint8) for i in range(5)]
    animation.durations = [40] * 5
    assert cv2.imwriteanimation(str(tmp_path / name), animation, [cv2.IMWRITE_WEBP_QUALITY, 100])
    info = probe_video(tmp_path / name)
    assert (info.frames, info.fps, info.width, info.height) == (5, 25.0, 24, 16)
    ds = VideoClipDataset(tmp_path, n_frames=3, height=8, width=12, stride_range=(2, 2), mode="val")
    levels = ds[0]["frames"].float().mean(dim=(1, 2, 3))
    assert torch.allclose(levels, torch.tensor([20.0, 100.0, 180.0]), atol=3), levels


@pytest.mark.parametrize("height,width,tolerance", [(240, 360, 0.0), (64, 96, 3.0)])
def test_pixels_match_a_plain_opencv_reference(videos_dir, tmp_path, height, width, tolerance):
    # Val mode with a 1-frame annotation: frame 0, centred full-scale crop, no flip.
    ann = annotate(tmp_path / "ann.json", [{"path": GOPRO, "frames": 1}])
    ds = VideoClipDataset(videos_dir, ann, n_frames=1, height=height, width=width, crop_scale=(1.0, 1.0), mode="val")
    ours = ds[0]["frames"][0].numpy().astype(np.float64)
    ok, bgr = cv2.VideoCapture(str(videos_dir / GOPRO)).read()
    y, x, h, w = crop_box(480, 848, height, width)  # 480x720 box, centred
    assert (y, x, h, w) == (0, 64, 480, 720)
    reference = cv2.resize(bgr[y : y + h, x : x + w], (width, height), interpolation=cv2.INTER_AREA)
    reference = reference[:, :, ::-1].transpose(2, 0, 1).astype(np.float64)  # RGB, CHW
    assert np.abs(ours - reference).mean() <= tolerance


def test_crop_has_output_aspect_not_square():
    for src_h, src_w in [(720, 1280), (480, 848), (1000, 300), (64, 64)]:
        for out_h, out_w in [(480, 720), (64, 96), (256, 256), (96, 64)]:
            for area in (0.3, 1.0):
                y, x, h, w = crop_box(src_h, src_w, out_h, out_w, area, 0.99, 0.01)
                assert 0 <= y and y + h <= src_h and 0 <= x and x + w <= src_w
                assert abs(w / h - out_w / out_h) < 1.5 / h
    # Full-scale centred crop of 1280x720 for 720x480 output: all the height, 1080 wide.
    assert crop_box(720, 1280, 480, 720, 1.0) == (0, 100, 720, 1080)
    assert crop_box(720, 1280, 480, 720, 0.25)[2:] == (360, 540)


# ----------------------------------------------------------------------- area resize


def inter_area(image: np.ndarray, width: int, height: int) -> np.ndarray:
    return cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA)


def abs_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a.astype(np.int16) - b.astype(np.int16))


@pytest.mark.parametrize(
    "src_hw,out_hw",
    [
        ((720, 1080), (480, 720)),
        ((643, 964), (480, 720)),
        ((720, 720), (256, 256)),
        ((480, 720), (64, 96)),
        ((339, 509), (480, 720)),
        ((481, 700), (480, 720)),
        ((720, 1280), (8, 8)),
        ((100, 60), (48, 32)),
    ],
)
def test_area_resize_gives_exact_non_square_shapes(src_hw, out_hw):
    image = np.random.default_rng(0).integers(0, 256, (*src_hw, 3), dtype=np.uint8)
    out = area_resize(image, out_hw[1], out_hw[0])
    assert out.shape == (*out_hw, 3) and out.dtype == np.uint8


# (area, u_y, u_x) of 720x480 crops; 0.7975 gives a 643x964 crop, whose scale factors hit
# OpenCV's floating-point floor at exact integers (56 levels off without the guard).
@pytest.mark.parametrize("out_hw", [(480, 720), (256, 256), (64, 96)])
@pytest.mark.parametrize("area,u_y,u_x", [(1.0, 0.5, 0.5), (0.7975, 0.3, 0.7), (0.667, 0.9, 0.1), (0.5, 0.2, 0.4)])
def test_area_resize_matches_inter_area_on_a_real_frame(videos_dir, out_hw, area, u_y, u_x):
    ok, frame = cv2.VideoCapture(str(videos_dir / START)).read()
    assert ok and frame.shape == (720, 1280, 3)
    y, x, h, w = crop_box(720, 1280, *out_hw, area, u_y, u_x)
    crop = frame[y : y + h, x : x + w]
    diff = abs_diff(area_resize(crop, out_hw[1], out_hw[0]), inter_area(crop, out_hw[1], out_hw[0]))
    assert diff.max() <= 1 and diff.mean() <= 0.25  # only the uint8 rounding of the sub-boxes


@pytest.mark.parametrize("src_hw", [(643, 964), (588, 882), (654, 981), (555, 832)])
def test_area_resize_has_no_misplaced_sub_boxes_on_noise(src_hw):
    # Noise makes a sub-box averaged over the wrong source pixel show up as a large error.
    image = np.random.default_rng(1).integers(0, 256, (*src_hw, 3), dtype=np.uint8)
    assert abs_diff(area_resize(image, 720, 480), inter_area(image, 720, 480)).max() <= 1


@pytest.mark.parametrize("src_hw,out_hw", [((643, 964), (480, 720)), ((720, 720), (256, 256)), ((30, 50), (64, 96))])
def test_area_resize_keeps_a_constant_image_constant(src_hw, out_hw):
    image = np.full((*src_hw, 3), (17, 137, 250), np.uint8)
    out = area_resize(image, out_hw[1], out_hw[0])
    assert (out == np.array((17, 137, 250), np.uint8)).all()


@pytest.mark.parametrize("factors", [(2, 2), (3, 3), (4, 4), (2, 3), (1, 2)])
def test_area_resize_integer_factors_agree_with_inter_area(factors):
    fy, fx = factors
    image = np.random.default_rng(2).integers(0, 256, (48 * fy, 72 * fx, 3), dtype=np.uint8)
    assert abs_diff(area_resize(image, 72, 48), inter_area(image, 72, 48)).max() <= 1


def test_area_resizer_reuses_buffers_without_mixing_frames():
    # One resizer fed images of changing content and size (its sub-box buffer is reused,
    # then reallocated) gives what a fresh resize of each image gives.
    rng = np.random.default_rng(3)
    resizer, out = AreaResizer(720, 480), np.empty((480, 720, 3), np.uint8)
    for src_hw in [(643, 964), (643, 964), (555, 832), (480, 720), (960, 1440), (643, 964)]:
        image = rng.integers(0, 256, (*src_hw, 3), dtype=np.uint8)
        assert resizer(image, out=out) is out
        assert np.array_equal(out, area_resize(image, 720, 480))


@pytest.mark.parametrize("flip", [False, True])
def test_clip_writer_writes_each_frame_as_rgb_planes(flip):
    # Distinct frames through the writer's shared buffers: frame k of the output is the
    # crop of input k, area-resized, flipped if asked, as RGB planes.
    rng = np.random.default_rng(4)
    frames = [rng.integers(0, 256, (720, 1280, 3), dtype=np.uint8) for _ in range(3)]
    writer = ClipWriter(3, 480, 720, area=0.7975, u_y=0.3, u_x=0.7, flip=flip)
    for k, frame in enumerate(frames):
        writer(frame, k)
    y, x, h, w = crop_box(720, 1280, 480, 720, 0.7975, 0.3, 0.7)
    for k, frame in enumerate(frames):
        expected = area_resize(frame[y : y + h, x : x + w], 720, 480)
        expected = expected[:, ::-1] if flip else expected
        assert np.array_equal(writer.frames[k], expected[..., ::-1].transpose(2, 0, 1))


# ------------------------------------------------------------------- decoding (OpenCV)


def test_video_stream_chosen_when_audio_is_stream_0(videos_dir):
    with av.open(str(videos_dir / START)) as container:
        assert container.streams[0].type == "audio"
    info = probe_video(videos_dir / START)
    assert (info.frames, info.width, info.height) == (200, 1280, 720)


def test_container_count_lies_but_probe_counts_decodable(videos_dir):
    with VideoReader(str(videos_dir / SHADOW)) as reader:
        assert reader.container_frame_count == 162
    assert probe_video(videos_dir / SHADOW).frames == 160
    with VideoReader(str(videos_dir / SHADOW)) as reader:
        frames, decoded = reader.read(start=150, stride=4, count=4)  # wants 150, 154, 158, 162
    assert len(frames) == 3 and decoded == 160


@pytest.mark.parametrize("name", [GOPRO, "imageio_cockatoo_yuv420.mp4"])  # GOP 10 and 76
def test_seek_gives_the_same_frames_as_reading_on(videos_dir, name):
    path = str(videos_dir / name)
    with VideoReader(path, seek_threshold=1) as seeking, VideoReader(path, seek_threshold=10**9) as reading:
        for start in (97, 40):  # forward jump, then backwards
            a, end_a = seeking.read(start, 3, 3)
            b, end_b = reading.read(start, 3, 3)
            assert end_a is None and end_b is None
            assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_full_range_yuvj420p_is_not_squeezed(videos_dir):
    path = str(videos_dir / GOPRO)
    with av.open(path) as container:
        frame = next(container.decode(video=0))
        assert frame.format.name == "yuvj420p"
        plane = frame.planes[0]
        luma = np.frombuffer(plane, np.uint8).reshape(-1, plane.line_size)[: frame.height, : frame.width]
    with VideoReader(path) as reader:
        (bgr,), _ = reader.read(0, 1, 1)
    ours = bgr.astype(np.float64) @ np.array([0.114, 0.587, 0.299])
    full = luma.astype(np.float64)
    limited = np.clip((full - 16) * 255 / 219, 0, 255)
    assert np.abs(ours - full).mean() < 2.5
    assert np.abs(ours - limited).mean() > 6


# ------------------------------------------------------------------- temporal sampling


def test_fit_stride_policies():
    assert fit_stride(100, 12, 5, "lower_stride") == 5
    assert fit_stride(20, 8, 4, "lower_stride") == 2  # (8 - 1) * 2 + 1 = 15 <= 20 < 22
    assert fit_stride(20, 8, 4, "skip") is None
    assert fit_stride(7, 8, 1, "lower_stride") is None
    assert fit_stride(8, 8, 3, "lower_stride") == 1
    assert fit_stride(1, 1, 5, "lower_stride") == 5


@pytest.mark.parametrize("frame_cache_mb", [0, 64])
def test_sampled_frames_increase_without_wraparound(index_dir, tmp_path, frame_cache_mb):
    entries = [{"path": "long.mp4", "frames": 30}] * 6  # six indices, six different draws
    ds = index_dataset(index_dir, tmp_path, entries, n_frames=8, stride_range=(1, 4), frame_cache_mb=frame_cache_mb)
    strides = set()
    for epoch in range(3):
        ds.set_epoch(epoch)
        for i in range(6):
            idx = frame_indices(ds[i]["frames"])
            steps = set(np.diff(idx).tolist())
            assert len(steps) == 1 and 1 <= min(steps) <= 4, idx
            assert 0 <= idx[0] and idx[-1] < 30
            strides |= steps
    assert len(strides) > 1  # the stride is drawn, not fixed


@pytest.mark.parametrize("frame_cache_mb", [0, 64])
def test_overstated_frame_count_samples_only_decodable_frames(index_dir, tmp_path, frame_cache_mb):
    # The annotation says 200 frames; 30 decode. Samples must come from those 30.
    entries = [{"path": "long.mp4", "frames": 200}] * 4
    ds = index_dataset(index_dir, tmp_path, entries, n_frames=6, stride_range=(5, 5), frame_cache_mb=frame_cache_mb)
    for i in range(4):
        sample = ds[i]
        idx = frame_indices(sample["frames"])
        assert sample["failures"] == 0 and idx[-1] < 30
        assert np.diff(idx).tolist() == [5] * 5


def test_the_frame_cache_decodes_each_video_once_within_its_budget(tmp_path):
    """Train mode keeps a video's downscaled frames after its first sample (the file is not
    read again), up to the budget; later videos are read from disk; val mode never caches."""
    for name in ("a", "b"):
        write_index_video(tmp_path / f"{name}.mp4", 24, height=240, width=320)
    entries = [{"path": "a.mp4", "frames": 24}, {"path": "b.mp4", "frames": 24}]
    ds = index_dataset(tmp_path, tmp_path, entries, n_frames=4, height=16, width=24, frame_cache_mb=1)
    first = ds[0]["frames"]
    # the smallest crop (half the area) is 151x226 of 240x320: 2 x 16/151 of the size is kept
    assert list(ds._frame_cache) == [0] and ds._frame_cache[0].frames.shape == (24, 51, 68, 3)
    (tmp_path / "a.mp4").rename(tmp_path / "gone.mp4")
    assert torch.equal(ds[0]["frames"], first)  # the same draw, from memory
    ds.frame_cache_bytes = ds._frame_cache_used + 1000  # less room than b's frames take
    assert ds[1]["failures"] == 0 and list(ds._frame_cache) == [0]
    (tmp_path / "annotations").mkdir()
    val = index_dataset(tmp_path, tmp_path / "annotations", [entries[1]], mode="val", frame_cache_mb=64)
    val[0]
    assert not val._frame_cache


def test_shadow_clip_container_count(videos_dir, tmp_path):
    # 2 frames at stride 160 need 161 frames: fits the claimed 162, not the 160 that decode.
    ann = annotate(tmp_path / "ann.json", [{"path": SHADOW, "frames": 162}])
    ds = VideoClipDataset(videos_dir, ann, n_frames=2, height=8, width=8, stride_range=(160, 160))
    sample = ds[0]
    assert sample["frames"].shape == (2, 3, 8, 8) and sample["failures"] == 0


def test_short_clip_lower_stride(index_dir, tmp_path):
    entries = [{"path": "short.mp4", "frames": 12}]
    ds = index_dataset(index_dir, tmp_path, entries, n_frames=6, stride_range=(4, 4))
    idx = frame_indices(ds[0]["frames"])
    assert np.diff(idx).tolist() == [2] * 5  # (6 - 1) * 2 + 1 = 11 <= 12


@pytest.mark.parametrize("policy,n_frames,stride", [("skip", 6, 3), ("lower_stride", 13, 2), ("skip", 13, 2)])
def test_short_clip_skipped_and_counted(index_dir, tmp_path, policy, n_frames, stride):
    options = dict(n_frames=n_frames, stride_range=(stride, stride), short_clip_policy=policy)
    # annotated as too short: left out up front and listed, never drawn
    ds = index_dataset(
        index_dir, tmp_path, [{"path": "short.mp4", "frames": 12}, {"path": "long.mp4", "frames": 30}], **options
    )
    assert len(ds) == 1 and ds.short_clips == [str(index_dir / "short.mp4")] and ds[0]["failures"] == 0
    # length unknown until decoded: skipped when drawn, counted in failures
    ds = index_dataset(index_dir, tmp_path, [{"path": "short.mp4"}, {"path": "long.mp4", "frames": 30}], **options)
    sample = ds[0]
    assert (sample["index"], sample["failures"]) == (1, 1)
    assert sample["frames"].shape[0] == n_frames


def test_bad_annotation_entries_are_refused_one_by_one_and_listed(index_dir, tmp_path):
    """Frame counts that are not positive whole numbers, and paths that leave data_root, are
    left out per entry with the reason (missing or null frames: the container says)."""
    entries = [
        {"path": "long.mp4", "frames": 30},
        {"path": "long.mp4", "frames": -5},
        {"path": "long.mp4", "frames": 0},
        {"path": "long.mp4", "frames": 2.5},
        {"path": "long.mp4", "frames": "many"},
        {"path": "../../../etc/passwd", "frames": 30},
        {"path": "long.mp4", "frames": None},
        {"path": "long.mp4", "frames": 30.0},
    ]
    ds = index_dataset(index_dir, tmp_path, entries, n_frames=8)
    assert len(ds) == 3 and list(ds.clips.frames) == [30, -1, 30]
    assert [why for _, why in ds.refused_entries] == [
        "entry 1: frames=-5 is not a positive whole number",
        "entry 2: frames=0 is not a positive whole number",
        "entry 3: frames=2.5 is not a positive whole number",
        "entry 4: frames='many' is not a positive whole number",
        f"entry 5: ../../../etc/passwd leaves {index_dir}",
    ]
    with pytest.raises(VideoDataError, match=r"no clips in .*\(1 entries refused, e.g. entry 0: frames=-5 is not"):
        index_dataset(index_dir, tmp_path, [{"path": "long.mp4", "frames": -5}], n_frames=8)


def test_only_short_clips_is_an_error_that_says_what_to_change_and_no_min_frames_that_keeps_nothing(
    index_dir, tmp_path
):
    with pytest.raises(
        VideoDataError, match=r"all 1 clips .* fewer than the 13 frames a sample needs.*lower n_frames or use longer"
    ) as error:
        index_dataset(index_dir, tmp_path, [{"path": "short.mp4", "frames": 12}], n_frames=13)
    assert "--min_frames" not in str(error.value)


def test_val_mode_is_fixed(index_dir, tmp_path):
    entries = [{"path": "long.mp4", "frames": 30}]
    ds = index_dataset(index_dir, tmp_path, entries, n_frames=8, stride_range=(1, 3), mode="val")
    first = ds[0]["frames"]
    ds.set_epoch(7)
    assert torch.equal(first, ds[0]["frames"])
    # middle stride 2, span 15, centred start (30 - 15) // 2 = 7
    assert frame_indices(first) == list(range(7, 22, 2))


def test_hflip_only_in_train_mode(tmp_path):
    path = tmp_path / "halves.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 25, (64, 64))
    frame = np.zeros((64, 64, 3), np.uint8)
    frame[:, 32:] = 255  # dark left, bright right
    for _ in range(4):
        writer.write(frame)
    writer.release()

    def left_is_dark(ds: VideoClipDataset, i: int) -> bool:
        f = ds[i]["frames"].float()
        return bool(f[..., :8].mean() < f[..., -8:].mean())

    kwargs = dict(n_frames=2, height=32, width=32, stride_range=(1, 1), crop_scale=(1.0, 1.0))
    train = VideoClipDataset(tmp_path, **kwargs)
    orientations = set()
    for epoch in range(12):
        train.set_epoch(epoch)
        orientations.add(left_is_dark(train, 0))
    assert orientations == {True, False}
    val = VideoClipDataset(tmp_path, mode="val", **kwargs)
    no_flip = VideoClipDataset(tmp_path, hflip=False, **kwargs)
    assert all(left_is_dark(val, 0) and left_is_dark(no_flip, 0) for _ in range(3))


# ------------------------------------------------------------------------ determinism


def test_same_seed_epoch_index_same_sample(demo_dir):
    def make(seed: int) -> VideoClipDataset:
        ann = demo_dir / "annotations_train.json"
        return VideoClipDataset(demo_dir, ann, n_frames=6, height=24, width=32, seed=seed)

    a, b = make(0), make(0)
    for i in range(len(a)):
        assert torch.equal(a[i]["frames"], b[i]["frames"])
    before = a[1]["frames"]
    a.set_epoch(1)
    assert not torch.equal(before, a[1]["frames"])
    b.set_epoch(1)
    assert torch.equal(a[1]["frames"], b[1]["frames"])
    assert not torch.equal(make(5)[1]["frames"], before)


def test_shuffle_order_depends_only_on_seed_and_epoch(demo_dir):
    ds = VideoClipDataset(demo_dir, demo_dir / "annotations_train.json")
    other = VideoClipDataset(demo_dir, demo_dir / "annotations_train.json")
    order0 = list(EpochShuffleSampler(ds, seed=3))
    assert sorted(order0) == list(range(len(ds)))
    assert list(EpochShuffleSampler(other, seed=3)) == order0
    orders = set()
    for epoch in range(6):
        sampler = EpochShuffleSampler(ds, seed=3)
        sampler.set_epoch(epoch)  # forwards to the dataset: one source of truth
        assert ds.epoch == epoch
        orders.add(tuple(sampler))
    assert len(orders) > 1


# ------------------------------------------------------------------------- bad inputs


@pytest.fixture
def bad_files(videos_dir, tmp_path) -> dict[str, Path]:
    (tmp_path / "zero.mp4").write_bytes(b"")
    (tmp_path / "notes.mp4").write_text("not a video\n" * 100)
    (tmp_path / "truncated.mp4").write_bytes((videos_dir / START).read_bytes()[:500_000])
    return {
        "missing": tmp_path / "missing.mp4",
        "zero": tmp_path / "zero.mp4",
        "text": tmp_path / "notes.mp4",
        "truncated": tmp_path / "truncated.mp4",
    }


def test_bad_files_replaced_deterministically_and_logged_once(index_dir, bad_files, tmp_path, caplog):
    good = [{"path": f"clip{i}.mp4", "frames": 24} for i in range(3)]
    bad = [{"full_path": str(p), "frames": 200} for p in bad_files.values()]
    ds = index_dataset(index_dir, tmp_path, good + bad)
    caplog.set_level(logging.WARNING, logger="taehv_train.common.clips")
    for i in range(3, 7):
        first, again = ds[i], ds[i]
        assert first["failures"] >= 1
        assert first["index"] < 3  # a good clip
        assert first["frames"].shape == (4, 3, 16, 24)
        assert (again["index"], again["failures"]) == (first["index"], first["failures"])
        assert torch.equal(first["frames"], again["frames"])
    for path in bad_files.values():
        assert sum(str(path) in r.getMessage() for r in caplog.records) == 1, path
    assert "missing" in caplog.text and "unreadable" in caplog.text


def test_special_files_are_listed_and_refused_without_being_opened(tmp_path):
    """A FIFO or a device named like a clip is listed by a folder scan and refused, unopened,
    as "not a regular file" wherever it is read: the start-up probe of a folder or of an
    annotation, and probe_video. Opening a FIFO would wait for a writer forever."""
    write_index_video(tmp_path / "clip.mp4", 6)
    (tmp_path / "null.webm").symlink_to(os.devnull)
    with fifos(tmp_path / "pipe.mp4", tmp_path / "pipe.png") as (pipe, _):
        assert find_videos(tmp_path, images=True) == ["clip.mp4", "null.webm", "pipe.mp4", "pipe.png"]
        folder = VideoClipDataset(tmp_path, n_frames=4, height=16, width=24, max_failure_fraction=0.5)
        with pytest.raises(VideoDataError, match=r"3 of 4 probed clips are unusable .*'not a regular file': 3"):
            folder.probe()
        listed = index_dataset(
            tmp_path, tmp_path, [{"path": "clip.mp4"}, {"path": "pipe.mp4"}], max_failure_fraction=0.5
        )
        assert listed.probe().reasons == {"not a regular file": 1}
        with pytest.raises(BadClipError, match="not a regular file: a FIFO"):
            probe_video(pipe)
    with pytest.raises(BadClipError, match="not a regular file: a character device"):
        probe_video(tmp_path / "null.webm")


@pytest.mark.parametrize(
    "name, write, reason",
    [
        ("huge.png", write_huge_header_png, "too large: its header claims more pixels than OpenCV reads"),
        ("audio.mp4", write_audio_only_mp4, "no video stream: it has only audio streams"),
        # FFmpeg reads this text as a 2x2 image stating a frame count of -2**63: what decodes counts
        ("netpbm.mp4", lambda p: p.write_text("P3\n2 2\n255\n" + "0 0 0 " * 4), "too short: 1 frames for 4"),
    ],
    ids=["huge-png-header", "audio-only-mp4", "text-read-as-an-image"],
)
def test_hostile_files_are_skipped_with_what_is_wrong(tmp_path, caplog, name, write, reason):
    """The start-up probe counts a file that cannot give a clip under its reason and logs
    what is wrong, with no OpenCV exception escaping."""
    write_index_video(tmp_path / "clip.mp4", 6)
    write(tmp_path / name)
    ds = index_dataset(tmp_path, tmp_path, [{"path": "clip.mp4"}, {"path": name}], max_failure_fraction=0.5)
    caplog.set_level(logging.WARNING, logger="taehv_train.common.clips")
    assert ds.probe().reasons == {reason.split(":")[0]: 1}
    assert f"({tmp_path / name}) skipped: {reason}" in caplog.text


def test_truncated_file_with_intact_index_uses_its_decodable_prefix(videos_dir, tmp_path):
    (tmp_path / "dog_cut.mp4").write_bytes((videos_dir / DOG).read_bytes()[:400_000])
    # The header still says 289 frames; far fewer decode.
    ds = VideoClipDataset(tmp_path, n_frames=3, height=16, width=16, stride_range=(1, 1), seek_threshold=10**9)
    decodable = probe_video(tmp_path / "dog_cut.mp4").frames
    assert 3 <= decodable < 150
    with VideoReader(str(tmp_path / "dog_cut.mp4")) as reader:
        assert reader.container_frame_count == 289
    sample = ds[0]
    assert sample["failures"] == 0 and sample["frames"].shape == (3, 3, 16, 16)


def test_replacement_is_iterative_and_bounded(tmp_path):
    # 3000 consecutive failures: a recursive implementation would hit the recursion limit.
    ann = annotate(tmp_path / "ann.json", [{"path": f"gone{i}.mp4", "frames": 100} for i in range(3)])
    ds = VideoClipDataset(tmp_path, ann, max_replacement_attempts=3000)
    with pytest.raises(VideoDataError, match="3001 clips in a row"):
        ds[0]


def test_validate_raises_above_failure_threshold(index_dir, bad_files, tmp_path):
    good = [{"path": f"clip{i}.mp4", "frames": 24} for i in range(3)]
    bad = [{"full_path": str(bad_files[k])} for k in ("missing", "zero")]
    ds = index_dataset(index_dir, tmp_path, good + bad, max_failure_fraction=0.25)
    with pytest.raises(VideoDataError, match="max_failure_fraction") as err:
        ds.probe(sample_size=10)
    assert "2 of 5" in str(err.value) and "make_annotations" in str(err.value)
    ds.max_failure_fraction = 0.5
    report = ds.probe(sample_size=10)
    assert (report.probed, report.failed) == (5, 2)
    assert report.reasons == {"missing": 1, "unreadable": 1}


def test_empty_sources_are_clear_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(VideoDataError, match="no clips.*make_annotations"):
        VideoClipDataset(tmp_path / "empty")
    ann = annotate(tmp_path / "ann.json", [])
    with pytest.raises(VideoDataError, match="no clips"):
        VideoClipDataset(tmp_path, ann)
    with pytest.raises(ValueError, match="annotation_file"):
        VideoClipDataset()


# ---------------------------------------------------------------------- annotations


def test_annotation_path_rules(tmp_path):
    (tmp_path / "ann").mkdir()
    ann = tmp_path / "ann" / "a.json"
    ann.write_text(
        json.dumps(
            {
                "total": 3,
                "list": [
                    {"path": "x/a.mp4", "full_path": "/abs/a.mp4", "frames": 5, "duration": 0.2},
                    {"path": "b.mp4"},
                    {"full_path": "/abs/c.mp4", "frames": 7},
                ],
            }
        )
    )
    with_root = ClipTable.from_annotation(ann, "/data")
    assert [with_root.path(i) for i in range(3)] == ["/data/x/a.mp4", "/data/b.mp4", "/abs/c.mp4"]
    without = ClipTable.from_annotation(ann)
    assert [without.path(i) for i in range(3)] == ["/abs/a.mp4", str(tmp_path / "ann" / "b.mp4"), "/abs/c.mp4"]
    assert with_root.frames.tolist() == [5, -1, 7]


def test_clip_table_is_compact_arrays():
    paths = [f"dir/clip_{i}_é.mp4" for i in range(1000)]
    table = ClipTable.from_lists("/root", paths, range(1000))
    assert table.path_bytes.dtype == np.uint8 and table.offsets.dtype == np.int64
    assert table.frames.dtype == np.int32 and len(table) == 1000
    assert table.path(0) == "/root/dir/clip_0_é.mp4" and table.path(999) == "/root/dir/clip_999_é.mp4"


# ----------------------------------------------------------------------- DataLoader


def test_dataloader_two_workers_survives_corrupt_file(index_dir, tmp_path):
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(np.random.default_rng(0).integers(0, 256, 50_000, dtype=np.uint8).tobytes())
    entries = [{"path": f"clip{i}.mp4", "frames": 24} for i in range(6)]
    entries.insert(3, {"full_path": str(corrupt), "frames": 24})
    ds = index_dataset(index_dir, tmp_path, entries)
    loader = build_dataloader(ds, batch_size=2, num_workers=2, shuffle=True, seed=0, drop_last=False)
    batches = list(loader)
    assert sum(b["frames"].shape[0] for b in batches) == 7
    assert all(b["frames"].shape[1:] == (4, 3, 16, 24) and b["frames"].dtype == torch.uint8 for b in batches)
    assert sum(int(b["failures"].sum()) for b in batches) == 1
    assert 3 not in torch.cat([b["index"] for b in batches]).tolist()


def test_persistent_workers_follow_set_epoch(index_dir, tmp_path):
    entries = [{"path": f"clip{i}.mp4", "frames": 24} for i in range(4)]
    ds = index_dataset(index_dir, tmp_path, entries, n_frames=6)
    loader = build_dataloader(ds, batch_size=2, num_workers=2, shuffle=False, persistent_workers=True)
    assert loader.persistent_workers and loader.prefetch_factor == 2
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        from_workers = torch.cat([b["frames"] for b in loader])
        in_process = torch.stack([ds[i]["frames"] for i in range(4)])
        assert torch.equal(from_workers, in_process), epoch


ACCELERATE_SHARDS = """
import sys
from accelerate.data_loader import prepare_data_loader
from taehv_train.training.data.clip_loader import EpochShuffleSampler, build_dataloader
from taehv_train.common.clips import VideoClipDataset

root = sys.argv[1]
ds = VideoClipDataset(root, root + "/annotations_train.json", n_frames=2, height=8, width=8)
shards = []
for rank in (0, 1):
    loader = build_dataloader(ds, batch_size=1, num_workers=0, seed=5)
    prepared = prepare_data_loader(loader, num_processes=2, process_index=rank, put_on_device=False)
    prepared.set_epoch(2)  # Accelerate forwards it through the sampler to the dataset
    assert ds.epoch == 2, ds.epoch
    shards.append([int(b["index"]) for b in prepared])
order = list(EpochShuffleSampler(ds, seed=5))  # epoch 2
full = len(order) // 2 * 2  # drop_last: only whole rounds of 2 ranks x batch 1
assert shards[0] == order[0:full:2] and shards[1] == order[1:full:2], (shards, order)
assert shards[0] and set(shards[0]).isdisjoint(shards[1])
print("ok")
"""


def run_in_a_fork(script: str, *argv: str) -> str:
    """What ``python -c script *argv`` prints, run in a fork of this process (its imports
    already done): its stdout, or its traceback when it fails."""
    reading, writing = multiprocessing.get_context("fork").Pipe(duplex=False)

    def child() -> None:
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                sys.argv = ["-c", *argv]
                exec(compile(script, "<script>", "exec"), {"__name__": "__main__"})
            writing.send(printed.getvalue())
        except BaseException:  # whatever ends the script (SystemExit too) goes to the parent, whose assert shows it
            writing.send(printed.getvalue() + traceback.format_exc())

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    writing.close()
    try:
        assert reading.poll(120), "the script did not finish in 120 s"
        return reading.recv()
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()


def test_accelerate_rank_sharding_and_set_epoch(demo_dir):
    # In another process: Accelerate's state is a process-wide singleton (the fork starts it
    # afresh, as a new process would, whatever this one's tests made of it)
    fresh = "from accelerate.state import AcceleratorState\nAcceleratorState._reset_state(reset_partial_state=True)\n"
    output = run_in_a_fork(fresh + ACCELERATE_SHARDS, str(demo_dir))
    assert output.strip() == "ok", output


def test_dataloader_without_workers_has_no_worker_options(index_dir, tmp_path):
    ds = index_dataset(index_dir, tmp_path, [{"path": "clip0.mp4", "frames": 24}])
    loader = build_dataloader(ds, batch_size=1, num_workers=0, persistent_workers=True, prefetch_factor=4)
    assert loader.num_workers == 0 and not loader.persistent_workers and loader.prefetch_factor is None
    assert isinstance(loader.sampler, EpochShuffleSampler)
    batch = next(iter(loader))
    assert batch["frames"].shape == (1, 4, 3, 16, 24)


def test_a_million_entries_are_held_in_flat_arrays_and_the_start_up_probes_64(index_dir, tmp_path):
    """An annotation of 1e6 entries (all one clip): the table stays a few bytes per entry,
    shared by forked workers, and the start-up probe reads 64 clips, not all of them."""
    entry = {"path": "long.mp4", "frames": 30}
    small = annotate_one_clip_many_times(tmp_path / "small.json", entry, 3)
    assert small.read_text() == annotate(tmp_path / "written.json", [entry] * 3).read_text()  # the users' format
    ann = annotate_one_clip_many_times(tmp_path / "ann.json", entry, 1_000_000)
    ds = VideoClipDataset(index_dir, ann, n_frames=8, height=16, width=24, stride_range=(1, 3), crop_scale=(0.5, 1.0))
    assert len(ds) == 1_000_000 and not ds.refused_entries
    table = ds.clips
    assert table.path_bytes.nbytes + table.offsets.nbytes + table.frames.nbytes <= 21 * 1_000_000  # path + 12 bytes
    assert ds.probe().probed == 64


def test_a_stop_signal_before_a_workers_init_leaves_it_running():
    """A job-wide SIGTERM can reach a DataLoader worker between its fork and its
    ``worker_init_fn``; the loader starts its workers with stop signals held, so the
    signal waits for the init (which ignores any SIGTERM not sent by the parent)."""

    def signalled_before_init(worker_id: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # not from the parent: must be ignored, not fatal
        tie_worker_to_parent(worker_id)

    for loader_class in (torch.utils.data.DataLoader, DataLoaderShard):  # plain, and as Accelerate prepares it
        loader = loader_class(list(range(6)), batch_size=2, num_workers=1, worker_init_fn=signalled_before_init)
        assert [batch.tolist() for batch in batches_until_data_error(loader)] == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_data_error_keeps_its_reason_from_a_worker(tmp_path, num_workers):
    """Every clip gone: the sample's VideoDataError reaches the training loop with the reason
    it was raised with, in this process or handed over by a worker."""
    ds = VideoClipDataset(tmp_path, annotate(tmp_path / "ann.json", [{"path": "gone.mp4", "frames": 24}]), n_frames=4)
    with pytest.raises(VideoDataError) as raised:
        ds[0]
    expected = (VideoDataError, raised.value.reason, str(raised.value))
    # ``raised`` holds this frame through its traceback: a cycle that would keep the loader's
    # worker running until a garbage collection, whose shutdown then waits 5 s for it
    del raised
    loader = build_dataloader(ds, batch_size=1, num_workers=num_workers, shuffle=False)
    [error] = list(batches_until_data_error(loader))
    assert (type(error), error.reason, str(error)) == expected
    assert error.reason == "sample 0: 11 clips in a row were unusable, see the warnings above"
