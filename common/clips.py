"""Video clip dataset for TAEHV training and evaluation: annotation or folder in, uint8 clips out.

Each sample is ``{"frames": uint8 [T, C, H, W], "index": int, "failures": int}``: RGB (C = 3),
or RGBA (C = 4) for a TAE with 4 image channels. A still image (PNG, WebP) is a one-frame
clip and an animated one a clip of all its frames, with their alpha for RGBA (dropped for
RGB); a video's frames are opaque.
``index`` is the clip actually used (a bad clip is replaced by another one) and
``failures`` counts the clips that had to be replaced while producing the sample, so the
training loop can sum it over batches even when samples come from worker processes.
Normalisation to [0, 1] happens on the device in the training loop, not here.

Sampling is a pure function of ``(seed, epoch, index)``: a resumed run, a different
worker count or Accelerate's rank sharding all see the same clips for the same indices.
See docs/data.md for the policies (short clips, bad files, seeking) and how to point
training at real videos.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from taehv_train.base.errors import (
    VideoDataError as VideoDataError,  # re-exported: lives in errors.py for clip_loader
)
from taehv_train.base.errors import counts_in_words
from taehv_train.common.clip_table import ClipTable
from taehv_train.common.epoch_dataset import EpochDataset, shared_epoch
from taehv_train.common.shard_source import RETRY, RetryPolicy
from taehv_train.common.video.crop import ClipWriter, crop_box
from taehv_train.common.video.files import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, BadClipError
from taehv_train.common.video.in_memory import DecodedVideo, ImageReader
from taehv_train.common.video.probe import open_clip
from taehv_train.common.video.reader import VideoReader

logger = logging.getLogger(__name__)

ShortClipPolicy = Literal["lower_stride", "skip"]
SizeOf = Callable[[int, int], tuple[int, int]]  # a clip's (width, height) -> its sample's (height, width)


def valid_short_clip_policy(policy: str) -> bool:
    """Whether ``policy`` is a ``ShortClipPolicy`` (see ``fit_stride``)."""
    return policy in ("lower_stride", "skip")


def valid_crop_scale(low: float, high: float) -> bool:
    """Whether ``(low, high)`` is a range of crop area fractions: 0 < low <= high <= 1."""
    return 0 < low <= high <= 1


def frames_to_unit(
    frames: torch.Tensor, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 frames as the dataset delivers them -> ``dtype`` in [0, 1] on ``device``: the one
    normalisation used by training, validation, the latent cache and inference."""
    return frames.to(device, non_blocking=True).to(dtype).div_(255)


def fit_stride(length: int, n_frames: int, stride: int, policy: ShortClipPolicy) -> int | None:
    """The stride to use for a clip of ``length`` decodable frames, or None to skip it.

    "lower_stride" lowers the stride to the largest one that fits; "skip" skips any clip
    too short for the drawn stride. Either way a clip shorter than ``n_frames`` is skipped.
    """
    if (n_frames - 1) * stride + 1 <= length:
        return stride
    if policy == "skip" or length < n_frames:
        return None
    return 1 if n_frames == 1 else (length - 1) // (n_frames - 1)


def frames_needed(n_frames: int, stride_min: int, policy: ShortClipPolicy) -> int:
    """Decodable frames a clip needs to give a sample: ``n_frames`` (the stride is lowered
    to fit), or at the smallest stride under ``policy="skip"``."""
    return n_frames if policy == "lower_stride" else (n_frames - 1) * stride_min + 1


def unusable_clips(clips: ClipTable, source: str, need: int, n_frames: int) -> VideoDataError | None:
    """The error when ``clips`` (from ``source``) can give no sample: none at all (every
    entry refused, or none listed), or annotated frame counts that say none has the ``need``
    frames a sample takes; None otherwise (a count not annotated is the container's, at
    load time). Never suggests ``--min_frames``, which would keep nothing; still images
    alone are named as such (one frame each)."""
    if not len(clips):
        refused = f" ({len(clips.refused)} entries refused, e.g. {clips.refused[0][1]})" if clips.refused else ""
        return VideoDataError(
            f"no clips in {source}{refused}: point data_root/annotation_file at your videos, write an "
            "annotation with `python -m taehv_train.training.make_annotations DIR -o annotations.json`, or "
            "generate demo data with `python -m taehv_train.training.demo_data OUT_DIR`"
        )
    if not ((clips.frames >= 0) & (clips.frames < need)).all():
        return None
    if all(Path(clips.path(i)).suffix.lower() in IMAGE_EXTENSIONS for i in range(len(clips))):
        return VideoDataError(
            f"{source} lists no videos, only {len(clips)} still images (one frame each), and a sample needs "
            f"{need} frames (n_frames={n_frames})",
            f"add videos ({', '.join(VIDEO_EXTENSIONS)}), or train on stills with n_frames=1",
        )
    return VideoDataError(
        f"all {len(clips)} clips in {source} have fewer than the {need} frames a sample needs (n_frames={n_frames})",
        "lower n_frames or use longer clips",
    )


@dataclass(frozen=True)
class ProbeReport:
    """Outcome of ``VideoClipDataset.probe``: unusable clips among those probed, by kind."""

    probed: int
    failed: int
    reasons: dict[str, int]

    @property
    def failure_fraction(self) -> float:
        return self.failed / max(self.probed, 1)

    def __str__(self) -> str:
        """In words, for the logs: "5 probed, all usable", "64 probed, 3 unusable (2 too short, 1 unreadable)"."""
        if not self.failed:
            return f"{self.probed} probed, all usable"
        return f"{self.probed} probed, {self.failed} unusable ({counts_in_words(self.reasons)})"


class VideoClipDataset(EpochDataset):
    """Map-style dataset of ``n_frames``-frame clips resized to exactly ``height x width``.

    Args:
        data_root: folder that annotation paths are relative to; scanned recursively for
            videos and images when there is no ``annotation_file``.
        annotation_file: users' JSON annotation, or a folder to scan.
        n_frames, height, width: output clip shape (T, C, H, W).
        channels: 3 (RGB: an image's alpha is dropped) or 4 (RGBA: images keep their alpha,
            videos are opaque).
        stride_range: inclusive (min, max) of the random temporal stride.
        crop_scale: (min, max) area fraction of the largest crop with the output aspect.
        hflip: random horizontal flips (train mode only).
        mode: "train" (random) or "val" (middle stride, centred start and crop, no flip,
            independent of the epoch).
        seed: base of every random draw; a sample depends only on (seed, epoch, index).
        short_clip_policy: "lower_stride" or "skip" (see ``fit_stride``).
        max_failure_fraction: ``probe`` raises above this fraction of bad clips.
        max_replacement_attempts: bad clips tried in a row before a sample raises.
        seek_threshold: jump in frames from which a seek is cheaper than reading on.
        decode_threads: FFmpeg threads per open video (1 suits many DataLoader workers).
        frame_cache_mb: train mode: keep each video's frames decoded in memory, downscaled
            to twice what the smallest crop needs, up to this many MB per loader process
            (0: off; videos beyond the budget are read from disk each time). Small crops
            from large videos then cost no seeking or decoding after a clip's first use;
            the crops come from the downscaled frames (a second area resize), so pixels
            differ slightly from uncached reads, identically in every run.
        shard_retry: how reads of clips in tar shards retry a transient fault.
    """

    def __init__(
        self,
        data_root: str | Path | None = None,
        annotation_file: str | Path | None = None,
        *,
        n_frames: int = 12,
        height: int = 64,
        width: int = 64,
        stride_range: tuple[int, int] = (1, 5),
        crop_scale: tuple[float, float] = (0.5, 1.0),
        hflip: bool = True,
        mode: Literal["train", "val"] = "train",
        seed: int = 0,
        short_clip_policy: ShortClipPolicy = "lower_stride",
        max_failure_fraction: float = 0.05,
        max_replacement_attempts: int = 10,
        seek_threshold: int = 32,
        decode_threads: int = 1,
        channels: int = 3,
        frame_cache_mb: int = 0,
        shard_retry: RetryPolicy = RETRY,
    ):
        if mode not in ("train", "val"):
            raise ValueError(f"mode must be 'train' or 'val', got {mode!r}")
        if not valid_short_clip_policy(short_clip_policy):
            raise ValueError(f"short_clip_policy must be 'lower_stride' or 'skip', got {short_clip_policy!r}")
        if not 1 <= stride_range[0] <= stride_range[1]:
            raise ValueError(f"stride_range must be (min, max) with 1 <= min <= max, got {stride_range}")
        if not valid_crop_scale(*crop_scale):
            raise ValueError(f"crop_scale must be (min, max) with 0 < min <= max <= 1, got {crop_scale}")
        if min(n_frames, height, width) < 1:
            raise ValueError(f"n_frames, height and width must be positive, got {n_frames}, {height}, {width}")
        if channels not in (3, 4):
            raise ValueError(f"channels must be 3 (RGB) or 4 (RGBA), got {channels}")

        self.clips, source = ClipTable.from_source(data_root, annotation_file, shard_retry)
        self.source = source  # the annotation file or scanned folder, as messages name it
        self.refused_entries = list(self.clips.refused)
        if self.refused_entries:
            logger.warning(
                "%d entries in %s are refused and left out, e.g. %s",
                len(self.refused_entries),
                source,
                self.refused_entries[0][1],
            )
        need = frames_needed(n_frames, stride_range[0], short_clip_policy)
        if (error := unusable_clips(self.clips, source, need, n_frames)) is not None:
            raise error

        self.n_frames, self.height, self.width, self.channels = n_frames, height, width, channels
        self.stride_range, self.crop_scale, self.hflip = stride_range, crop_scale, hflip
        self.mode, self.seed, self.short_clip_policy = mode, seed, short_clip_policy
        self.short_clips = self._leave_out_short_clips(source)
        self.max_failure_fraction = max_failure_fraction
        self.max_replacement_attempts = max_replacement_attempts
        self.seek_threshold, self.decode_threads = seek_threshold, decode_threads
        self.frame_cache_bytes = frame_cache_mb << 20 if mode == "train" else 0
        self._frame_cache: dict[int, DecodedVideo] = {}
        self._frame_cache_used = 0
        self._epoch = shared_epoch()
        self._reported: set[tuple[int, int]] = set()  # (clip, log level) already logged here

    @property
    def min_frames(self) -> int:
        """Decodable frames a clip needs to give a sample: ``n_frames`` (the stride is lowered
        to fit), or at the smallest stride under ``short_clip_policy="skip"``."""
        return frames_needed(self.n_frames, self.stride_range[0], self.short_clip_policy)

    def _leave_out_short_clips(self, source: str) -> list[str]:
        """Leave out, up front, the clips whose annotated frame count is below ``min_frames``,
        and count them: a clip that can never give a sample would only be drawn, fail and be
        replaced. Returns their paths. Clips of unknown length are checked when loaded."""
        need = self.min_frames
        short = (self.clips.frames >= 0) & (self.clips.frames < need)
        if not short.any():
            return []
        logger.warning(
            "%d of %d clips in %s have fewer than the %d frames a sample needs (n_frames=%d) and are left out; "
            "`python -m taehv_train.training.make_annotations DIR -o annotations.json --min_frames %d` writes an "
            "annotation without them",
            short.sum(),
            len(short),
            source,
            need,
            self.n_frames,
            need,
        )
        left_out = [self.clips.path(i) for i in np.flatnonzero(short)]
        self.clips = self.clips.subset(np.flatnonzero(~short))
        return left_out

    def __len__(self) -> int:
        return len(self.clips)

    def _rng(self, index: int) -> np.random.Generator:
        epoch = 0 if self.mode == "val" else self.epoch
        return np.random.default_rng([self.seed, epoch, index])

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} clips")
        rng = self._rng(index)
        clip = index
        for failures in range(self.max_replacement_attempts + 1):
            try:
                frames = self._load(clip, rng)
            except BadClipError as err:
                self._log_once(clip, logging.WARNING, f"skipped: {err}")
                # Deterministic replacement: another index from the sample's own generator.
                clip = (clip + 1 + int(rng.integers(max(len(self) - 1, 1)))) % len(self)
                continue
            return {"frames": frames, "index": clip, "failures": failures}
        raise VideoDataError(
            f"sample {index}: {self.max_replacement_attempts + 1} clips in a row were unusable, see the warnings above",
            "If files were removed or a storage mount went away, restore them; otherwise clean the "
            "annotation with `python -m taehv_train.training.make_annotations` or raise max_replacement_attempts",
        )

    def load_clip(self, index: int, size_of: SizeOf | None = None) -> torch.Tensor:
        """Clip ``index`` exactly as ``__getitem__`` draws it, without replacement: raises
        BadClipError when it cannot give a sample (evaluation skips and reports it rather
        than averaging another clip in). ``size_of`` gives the sample's (height, width) from
        the clip's own (width, height) instead of ``height x width`` (evaluation at each
        clip's native size); it may raise BadClipError too."""
        return self._load(int(index), self._rng(int(index)), size_of)

    def _log_once(self, clip: int, level: int, message: str) -> None:
        key = (clip, level)
        if key not in self._reported:
            self._reported.add(key)
            logger.log(level, "clip %d (%s) %s", clip, self.clips.path(clip), message)

    def _draw_window(self, length: int, rng: np.random.Generator) -> tuple[int, int]:
        lo, hi = self.stride_range
        stride = (lo + hi) // 2 if self.mode == "val" else int(rng.integers(lo, hi + 1))
        fitted = fit_stride(length, self.n_frames, stride, self.short_clip_policy)
        if fitted is None:
            raise BadClipError(
                "too short",
                f"{length} frames for {self.n_frames} frames at stride {stride} "
                f"(short_clip_policy={self.short_clip_policy!r})",
            )
        last_start = length - ((self.n_frames - 1) * fitted + 1)
        start = last_start // 2 if self.mode == "val" else int(rng.integers(last_start + 1))
        return start, fitted

    def _load(self, clip: int, rng: np.random.Generator, size_of: SizeOf | None = None) -> torch.Tensor:
        path = self.clips.path(clip)
        if self.mode == "val":
            area, u_y, u_x, flip = self.crop_scale[1], 0.5, 0.5, False
        else:
            area = float(rng.uniform(*self.crop_scale))
            u_y, u_x = (float(u) for u in rng.random(2))
            flip = self.hflip and bool(rng.random() < 0.5)
        with self._open(clip, path) as reader:
            height, width = size_of(*reader.size) if size_of is not None else (self.height, self.width)
            writer = ClipWriter(self.n_frames, height, width, area, u_y, u_x, flip, self.channels)
            length = int(self.clips.frames[clip])
            if length < 0:
                length = reader.container_frame_count
            if length < 0:  # the container does not say: count what decodes
                length = reader.count_frames()
                self._log_once(clip, logging.INFO, f"states no frame count; {length} frames decode")
            if length == 0:
                raise BadClipError("no decodable frames")
            start, stride = self._draw_window(length, rng)
            _, decoded = reader.read(start, stride, self.n_frames, writer)
            if decoded is not None:
                # Container (and some annotation) counts can exceed what decodes: draw
                # again within the frames that really decode.
                if decoded == 0:
                    raise BadClipError("no decodable frames")
                self._log_once(clip, logging.INFO, f"decodes {decoded} frames, not {length}; sampling within them")
                start, stride = self._draw_window(decoded, rng)
                _, again = reader.read(start, stride, self.n_frames, writer)
                if again is not None:
                    raise BadClipError("truncated", f"decoding stopped at frame {again}, then at {decoded} before")
        return torch.from_numpy(writer.frames)

    def _open(self, clip: int, path: str) -> VideoReader | ImageReader | DecodedVideo:
        """The reader for clip ``clip``: its cached frames, decoded now if the cache has room,
        else the file."""
        if not self.frame_cache_bytes or Path(path).suffix.lower() in IMAGE_EXTENSIONS:
            return open_clip(self.clips.clip(clip), seek_threshold=self.seek_threshold, threads=self.decode_threads)
        if clip in self._frame_cache:
            return self._frame_cache[clip]
        if self._frame_cache_used >= self.frame_cache_bytes:
            return open_clip(self.clips.clip(clip), seek_threshold=self.seek_threshold, threads=self.decode_threads)
        video = DecodedVideo.decode(self.clips.clip(clip), self._cache_scale, self.decode_threads)
        if self._frame_cache_used + video.frames.nbytes <= self.frame_cache_bytes:
            self._frame_cache[clip] = video
            self._frame_cache_used += video.frames.nbytes
        return video

    def _cache_scale(self, height: int, width: int) -> float:
        """The downscale factor of a cached video: its smallest crop keeps twice the output size."""
        _, _, h, w = crop_box(height, width, self.height, self.width, self.crop_scale[0])
        return max(2 * self.height / h, 2 * self.width / w)

    def probe(self, sample_size: int = 64) -> ProbeReport:
        """Load up to ``sample_size`` clips (seeded choice) without replacement and raise
        VideoDataError if more than ``max_failure_fraction`` of them are unusable.

        Call once at start-up so that a wrong data path or a broken dataset stops the run
        before training instead of being papered over by replacements.
        """
        n = min(sample_size, len(self))
        picks = np.sort(np.random.default_rng([self.seed, 1]).choice(len(self), size=n, replace=False))
        reasons: dict[str, int] = {}
        examples: list[str] = []
        for clip in picks.tolist():
            try:
                self._load(clip, self._rng(clip))
            except BadClipError as err:
                self._log_once(clip, logging.WARNING, f"skipped: {err}")
                reasons[err.kind] = reasons.get(err.kind, 0) + 1
                examples.append(self.clips.path(clip))
        report = ProbeReport(probed=n, failed=len(examples), reasons=reasons)
        logger.info("probed clips: %s", report)
        if report.failure_fraction > self.max_failure_fraction:
            # --min_frames only where it keeps some of the clips probed
            min_frames = f" --min_frames {self.n_frames}" if "too short" in reasons and report.failed < n else ""
            raise VideoDataError(
                f"{report.failed} of {n} probed clips are unusable ({report.failure_fraction:.0%} > "
                f"max_failure_fraction={self.max_failure_fraction:.0%}) in {self.source}; reasons: {reasons}; e.g. "
                f"{examples[:3]}",
                "Check it and data_root, regenerate the annotation with "
                f"`python -m taehv_train.training.make_annotations DIR -o annotations.json{min_frames}` "
                "(it drops unusable files"
                + (" and clips shorter than n_frames" if min_frames else "")
                + "), or raise max_failure_fraction.",
            )
        return report
