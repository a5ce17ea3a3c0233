"""One way in for training data: the datasets a config describes, and where each batch's
reference latents come from.

    data = build_training_data(config, ref_vae)   # probes the clips, opens the latent cache
    loader = build_train_loader(data.train, config, device, processes)
    batches = Prefetcher(loader, accelerator, progress)  # training.data.prefetch: from where the run is
    z_ref = data.latents(batch, frames, generator)  # in the training step

The latents come from exactly one source, decided here once: the latent cache (its
dataset items carry them), the frozen reference VAE run on the batch, or nowhere (plain
autoencoder training without a reference VAE).
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch.utils.data import DataLoader, Dataset

from taehv_train.common.annotation_file import AnnotationFileError
from taehv_train.common.clip_table import ClipTable
from taehv_train.common.clips import (
    VideoClipDataset,
    VideoDataError,
    frames_needed,
    unusable_clips,
    valid_crop_scale,
    valid_short_clip_policy,
)
from taehv_train.common.config import SOURCE_KEYS, TrainConfig, spec_of
from taehv_train.common.metrics import lpips_unavailable_reason
from taehv_train.common.reference_vae import ReferenceVAE
from taehv_train.common.shard_source import RetryPolicy, is_shard_source, source_errors
from taehv_train.common.video.files import clip_extensions, holds_clips
from taehv_train.models.variants import VariantSpec
from taehv_train.training.data.clip_loader import build_dataloader, stop_signals_held
from taehv_train.training.data.latent_cache import CachedLatentDataset
from taehv_train.training.data.loader_workers import worker_death

logger = logging.getLogger(__name__)


def config_errors(config: TrainConfig, spec: VariantSpec) -> list[str]:
    """What is wrong with the data keys: sizes the variant can take, frames, strides, crops."""
    found, multiple = [], 8 * spec.patch_size
    if config.height % multiple or config.width % multiple:
        found.append(
            f"height and width must be multiples of {multiple} (8 * patch_size of {spec.name}), "
            f"got {config.height}x{config.width}"
        )
    if (config.val_height == 0) != (config.val_width == 0):
        found.append(
            f"set both val_height and val_width (positive), or neither, got {config.val_height}x{config.val_width}"
        )
    if config.val_height % multiple or config.val_width % multiple:
        found.append(
            f"val_height and val_width must be multiples of {multiple} (8 * patch_size of {spec.name}), "
            f"got {config.val_height}x{config.val_width}"
        )
    if config.stride_min > config.stride_max:
        found.append("need stride_min <= stride_max")
    if not valid_crop_scale(config.crop_scale_min, config.crop_scale_max):
        found.append("need 0 < crop_scale_min <= crop_scale_max <= 1")
    if not valid_short_clip_policy(config.short_clip_policy):
        found.append("short_clip_policy must be 'lower_stride' or 'skip'")
    if not (config.data_root or config.annotation_file):
        found.append("set data_root (a folder of videos) or annotation_file")
    for key in SOURCE_KEYS:
        if (value := getattr(config, key)) and is_shard_source(value):
            found += [f"{key}: {error}" for error in source_errors(value)]
    scanned = config.data_root if not config.annotation_file else config.annotation_file
    if scanned and Path(scanned).is_dir() and not holds_clips(scanned):  # found now, before any run folder exists
        found.append(
            f"{scanned} holds no videos or images ({', '.join(clip_extensions(images=True))}): point data_root "
            "at your clips"
        )
    return [*found, *annotation_errors(config)]


def notes(config: TrainConfig) -> list[str]:
    """A data folder scanned without annotation files has no validation set: the tool
    that splits it, and prints the command that trains on the split."""
    if config.annotation_file or config.val_annotation_file or not config.data_root:
        return []
    annotate = shlex.join(
        [
            "python",
            "-m",
            "taehv_train.training.make_annotations",
            config.data_root,
            "-o",
            f"{config.data_root}/annotations.json",
        ]
    )
    return [
        f"no annotation file: training scans data_root {config.data_root} for clips and has no validation set; "
        f"`{annotate}` splits them into training and validation files and prints the command that trains on them"
    ]


def annotation_errors(config: TrainConfig) -> list[str]:
    """The annotation files read now, as the datasets will read them, so that a damaged file
    or one whose clips can give no sample (all refused, all too short, stills alone) is
    found before any run folder exists: one line each. A folder is scanned at load time
    (frame counts unknown); a missing file is ``missing_paths``'."""
    files = [config.annotation_file]
    if config.num_validation_samples > 0:
        files.append(config.val_annotation_file)
    need = frames_needed(config.n_frames, config.stride_min, config.short_clip_policy)
    found = []
    for file in files:
        if not file or is_shard_source(file) or not Path(file).is_file():
            continue
        try:
            clips = ClipTable.from_annotation(file, config.data_root or None)
        except AnnotationFileError as err:
            found.append(str(err))
            continue
        if (error := unusable_clips(clips, str(file), need, config.n_frames)) is not None:
            found.append(str(error))
    return found


def build_datasets(config: TrainConfig) -> tuple[VideoClipDataset, VideoClipDataset | None]:
    """The training clips (random windows, crops and flips) and the held-out clips (None
    without ``val_annotation_file`` or with ``num_validation_samples=0``)."""
    common = dict(
        n_frames=config.n_frames,
        height=config.height,
        width=config.width,
        seed=config.seed,
        short_clip_policy=config.short_clip_policy,
        max_failure_fraction=config.max_failure_fraction,
        stride_range=(config.stride_min, config.stride_max),
        channels=spec_of(config).image_channels,
        shard_retry=RetryPolicy(config.shard_read_attempts, max_wait_s=config.shard_retry_wait_s),
    )
    data_root = config.data_root or None
    train = VideoClipDataset(
        data_root,
        config.annotation_file or None,
        mode="train",
        crop_scale=(config.crop_scale_min, config.crop_scale_max),
        hflip=config.hflip,
        frame_cache_mb=config.frame_cache_mb,
        **common,
    )
    val = None
    if config.val_annotation_file and config.num_validation_samples > 0:
        height, width = config.validation_size
        val = VideoClipDataset(
            data_root, config.val_annotation_file, mode="val", **(common | dict(height=height, width=width))
        )
    return train, val


@dataclass
class ReferenceLatents:
    """Where a batch's reference latents come from: ``cached`` (the batch carries them),
    else ``vae`` encodes the batch's frames, else there are none."""

    vae: ReferenceVAE | None
    cached: bool

    @property
    def available(self) -> bool:
        return self.cached or self.vae is not None

    def __call__(self, batch: dict, frames: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
        """Raw NTCHW float32 latents of ``frames`` (the batch's frames in [0, 1]), or None."""
        if self.cached:
            return batch["latents"].to(frames.device, non_blocking=True).float()
        if self.vae is not None:
            return self.vae.encode(frames, generator)
        return None


@dataclass
class TrainingData:
    train: Dataset  # a VideoClipDataset, wrapped by CachedLatentDataset with a latent cache
    val: VideoClipDataset | None
    latents: ReferenceLatents


def build_training_data(config: TrainConfig, ref_vae: ReferenceVAE | None) -> TrainingData:
    """The datasets of ``config``, probed alike (a broken training or validation set stops
    here, not at the first validation hours later), and the one source of reference
    latents: the cache when ``latent_cache_dir`` is set (checked against the config and the
    clips), else ``ref_vae`` online, else none."""
    train, val = build_datasets(config)
    logger.info("training clips: %d (%s)", len(train), train.probe())
    if val is not None:
        logger.info("validation clips: %d (%s)", len(val), val.probe())
        if len(val) == 1:
            logger.warning(
                "the validation set is one clip (%s): its scores follow that clip alone, a noisy guide to the "
                "best weights; hold out more clips (make_annotations --val_fraction)",
                config.val_annotation_file,
            )
        if (reason := lpips_unavailable_reason()) is not None:  # said here, before the progress bar
            logger.info("val/lpips is left out: %s", reason)
    if not config.latent_cache_dir:
        return TrainingData(train, val, ReferenceLatents(ref_vae, cached=False))
    cached = CachedLatentDataset.from_config(train, config)
    logger.info("reference latents from the cache %s (%d epochs)", config.latent_cache_dir, cached.cache.epochs)
    return TrainingData(cached, val, ReferenceLatents(ref_vae, cached=True))


def check_full_batches(dataset: Dataset, batch_size: int, processes: int) -> None:
    """A VideoDataError when ``dataset`` cannot give every training process a full batch per
    epoch: the loader drops the last incomplete batch and Accelerate the last incomplete
    round of batches across processes, so every epoch would be empty and the run would wait
    for a batch that never comes (``batch_timeout``)."""
    if len(dataset) // batch_size >= processes:
        return
    who = "the training process" if processes == 1 else f"each of the {processes} training processes"
    raise VideoDataError(
        f"{len(dataset)} training clips make {len(dataset) // batch_size} full batches of train_batch_size="
        f"{batch_size}, and {who} needs one per step",
        f"Add clips (at least {batch_size * processes}), or lower train_batch_size or the number of processes",
    )


def build_train_loader(dataset: Dataset, config: TrainConfig, device: torch.device, processes: int) -> DataLoader:
    """The shuffled, epoch-seeded training loader (pinned batches on CUDA) for one of
    ``processes`` training processes."""
    return build_dataloader(
        dataset,
        config.train_batch_size,
        config.dataloader_num_workers,
        shuffle=True,
        seed=config.seed,
        drop_last=True,
        prefetch_factor=config.prefetch_factor,
        persistent_workers=config.persistent_workers,
        pin_memory=device.type == "cuda",
        processes=processes,
        shuffle_buffer=config.shard_shuffle_buffer,
    )


def batches_until_data_error(loader: Iterable[dict]) -> Iterator[dict | VideoDataError]:
    """The loader's batches; when the data can no longer produce one (files deleted or a
    storage mount gone mid-run, or a loader worker died: ``LoaderFault``), the
    VideoDataError takes that batch's place and ends the iteration, so the training step
    can tell every rank and the run can save and stop."""
    # the workers start with stop signals held: at iter() of a DataLoader, at the first batch
    # of a prepared one (Accelerate's loaders iterate in a generator, which starts on next())
    with stop_signals_held():
        batches = iter(loader)
    starting = True
    while True:
        try:
            if starting:
                with stop_signals_held():
                    batch = next(batches)
                starting = False
            else:
                batch = next(batches)
        except StopIteration:
            return
        except VideoDataError as err:  # a worker's too, with its reason (training.data.clip_loader.WorkerDataError)
            yield err
            return
        except (RuntimeError, OSError, EOFError) as err:  # what the loader raises when a worker dies
            died = worker_death(err)
            if died is None:
                raise
            yield died
            return
        yield batch


class DataPosition(Protocol):
    """Where a run is in its training data (saved with its progress)."""

    epoch: int
    batch_in_epoch: int  # micro-batches of this epoch already taken (per process)

    def take(self, epoch: int, index: int) -> None:
        """The step took batch ``index`` of ``epoch``: the position moves to it."""
