"""Reading the reference-latent cache that ``python -m taehv_train.training.build_latent_cache`` builds.

The dataset draws every sample from ``(seed, epoch, index)``, so the latents of
``dataset[index]`` at ``epoch`` are a fixed tensor: the cache stores them for epochs
``0 .. latent_cache_epochs - 1`` and training reuses epoch ``e % latent_cache_epochs``
(``CachedLatentDataset``, wrapped around the training set by ``training.data.loading``). Sampled
latents use a generator seeded per sample (``latent_sample_generator``), so a cache does
not depend on batching, sharding, the number of processes or restarts.

Layout (docs/latent_cache.md): ``manifest.json`` (what the cache is valid for) and
``epoch{e:03d}/shard{k:06d}.safetensors``, each holding ``latents`` [n, T', C, h, w] and
``clips`` [n] (the clip each sample actually used) for indices ``k * shard_size`` onwards,
with each latent row's CRC-32 in the metadata: a damaged row is an error when it is read
(the run saves and stops, like any data gone bad), a shard whose header does not open is
refused at start-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from taehv_train.base.errors import UserError
from taehv_train.common.clips import VideoClipDataset, VideoDataError
from taehv_train.common.config import TrainConfig
from taehv_train.common.epoch_dataset import EpochDataset, shared_epoch
from taehv_train.models.latent_spaces import RAW
from taehv_train.models.variants import get_variant

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
CACHE_MANIFEST = "manifest.json"
SAMPLING_STREAM = 0x1A7E  # keeps the latent noise stream apart from the dataset's (seed, epoch, index) draws
REBUILD_SHARDS = (
    "delete the damaged shard(s) and rerun `python -m taehv_train.training.build_latent_cache` with the same "
    "settings (it computes only the missing shards)"
)
ROW_CRC32 = "row_crc32"  # shard metadata: the CRC-32 of every latent row, comma-separated
VALIDITY_HELP = (
    "rebuild it with `python -m taehv_train.training.build_latent_cache --config <this config>`, or set "
    "latent_cache_dir='' to compute reference latents online"
)


def latent_sample_generator(seed: int, epoch: int, index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator for ``latent_dist.sample()`` of sample ``index`` at ``epoch``: one per
    sample, so its noise depends on nothing but (seed, epoch, index). The cache builder uses
    CPU generators, whose stream is the same on every machine (CUDA's differs)."""
    state = np.random.SeedSequence([seed, epoch, index, SAMPLING_STREAM]).generate_state(1, np.uint64)[0]
    return torch.Generator(device).manual_seed(int(state))


def config_errors(config: TrainConfig) -> list[str]:
    """What is wrong with the latent-cache keys."""
    if config.latent_cache_dir and not config.ref_vae_path:
        return ["latent_cache_dir holds reference latents: set ref_vae_path to the VAE the cache was made with"]
    return []


def shard_path(directory: Path, epoch: int, shard: int) -> Path:
    """Where shard ``shard`` (indices ``shard * shard_size`` onwards) of ``epoch`` lives."""
    return directory / f"epoch{epoch:03d}" / f"shard{shard:06d}.safetensors"


def _file_digest(path: str) -> str:
    """sha256 of an annotation file: the same name with other clips is another dataset."""
    if not path or not Path(path).is_file():
        return ""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def validity(config: TrainConfig, n_clips: int) -> dict:
    """Every setting that changes the cached latents: the frames (data and its random
    draws) and the reference VAE. Two configs with the same validity share a cache."""
    return {
        "data_root": config.data_root,
        "annotation_file": config.annotation_file,
        "annotation_sha256": _file_digest(config.annotation_file),
        "n_clips": n_clips,
        "n_frames": config.n_frames,
        "height": config.height,
        "width": config.width,
        "stride_min": config.stride_min,
        "stride_max": config.stride_max,
        "crop_scale_min": config.crop_scale_min,
        "crop_scale_max": config.crop_scale_max,
        "hflip": config.hflip,
        "seed": config.seed,
        "short_clip_policy": config.short_clip_policy,
        "ref_vae_path": config.ref_vae_path,
        "ref_vae_class": config.ref_vae_class,
        "ref_vae_subfolder": config.ref_vae_subfolder,
        "ref_vae_dtype": config.ref_vae_dtype,
        "ref_latent_sample": config.ref_latent_sample,
        "latent_channels": get_variant(config.variant).latent_channels,
        "latent_space": config.latent_space,
        "epochs": config.latent_cache_epochs,
    }


def row_crc32(row: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (any dtype, bfloat16 included)."""
    return zlib.crc32(row.contiguous().view(torch.uint8).numpy())


def differences(cached: dict, wanted: dict) -> list[str]:
    """``key: cache X, now Y`` for every key whose value differs."""
    return [
        f"{key}: cache {cached.get(key)!r}, now {wanted.get(key)!r}"
        for key in sorted(set(cached) | set(wanted))
        if cached.get(key) != wanted.get(key)
    ]


def read_cache_manifest(directory: Path) -> dict | None:
    """The cache's manifest, or None when ``directory`` holds none."""
    path = directory / CACHE_MANIFEST
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    manifest.get("valid_for", {}).setdefault("latent_space", RAW)  # caches that do not say hold raw latents
    return manifest


class LatentCache:
    """Read access to a cache folder: ``latents(epoch, index)`` from lazily opened,
    memory-mapped shards (only the requested row is read)."""

    max_open_shards = 32  # bounded: a long run touches thousands of shards

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        manifest = read_cache_manifest(self.directory)
        if manifest is None:
            raise UserError(
                f"{self.directory} is not a latent cache (no {CACHE_MANIFEST}); build it with "
                "`python -m taehv_train.training.build_latent_cache --config <config> --output DIR`"
            )
        if manifest.get("format") != FORMAT_VERSION:
            raise UserError(
                f"latent cache {self.directory} has format {manifest.get('format')}, this code reads "
                f"format {FORMAT_VERSION}: {VALIDITY_HELP}"
            )
        self.manifest = manifest
        self.epochs: int = manifest["valid_for"]["epochs"]
        self.n_clips: int = manifest["valid_for"]["n_clips"]
        self.shard_size: int = manifest["storage"]["shard_size"]
        self._open: OrderedDict[Path, object] = OrderedDict()

    @property
    def n_shards(self) -> int:
        return math.ceil(self.n_clips / self.shard_size)

    def shard_paths(self) -> list[Path]:
        return [
            shard_path(self.directory, epoch, shard) for epoch in range(self.epochs) for shard in range(self.n_shards)
        ]

    def missing_shards(self) -> list[Path]:
        return [path for path in self.shard_paths() if not path.is_file()]

    def damaged_shards(self) -> list[str]:
        """``path (why)`` for each shard whose header does not open or whose rows are not
        the manifest's: reads only the headers."""
        found, unchecked = [], 0
        for path in self.shard_paths():
            try:
                _, shapes, crcs = self._open_shard(path)
            except VideoDataError as err:
                found.append(str(err))
                continue
            unchecked += crcs is None
            rows = shapes.get("clips", (0,))[0]
            index = int(path.stem.removeprefix("shard"))
            expected = min(self.shard_size, self.n_clips - index * self.shard_size)
            if rows != expected:
                found.append(f"{path} holds {rows} rows, the manifest says {expected}")
        self._open.clear()
        if unchecked:
            logger.warning(
                "latent cache %s: %d shard(s) were built before row checksums, so bytes damaged inside "
                "them go undetected; rebuild the cache to add them",
                self.directory,
                unchecked,
            )
        return found

    def check(self, config: TrainConfig, n_clips: int) -> None:
        """Raise UserError unless this cache holds the latents ``config`` would compute
        for a dataset of ``n_clips`` clips, for every cached epoch, in shards that open."""
        mismatches = differences(self.manifest["valid_for"], validity(config, n_clips))
        if mismatches:
            raise UserError(
                f"latent cache {self.directory} was made for other settings ({'; '.join(mismatches)}): {VALIDITY_HELP}"
            )
        missing = self.missing_shards()
        if missing:
            raise UserError(
                f"latent cache {self.directory} is incomplete: {len(missing)} shard(s) missing "
                f"(e.g. {missing[0]}); rerun `python -m taehv_train.training.build_latent_cache` with the same "
                "settings to finish it"
            )
        damaged = self.damaged_shards()
        if damaged:
            raise UserError(
                f"latent cache {self.directory} has {len(damaged)} damaged shard(s) (e.g. {damaged[0]}): "
                f"{REBUILD_SHARDS}"
            )

    def _open_shard(self, path: Path) -> tuple[object, dict[str, tuple], list[int] | None]:
        """(handle, shapes by name, row CRCs or None for a cache built before checksums),
        from the most recently used shards."""
        entry = self._open.pop(path, None)
        if entry is None:
            try:
                handle = safe_open(str(path), framework="pt")
                shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
            except (SafetensorError, OSError) as err:
                raise VideoDataError(f"{path} does not open ({err})") from err
            crcs = (handle.metadata() or {}).get(ROW_CRC32)
            entry = handle, shapes, [int(crc) for crc in crcs.split(",")] if crcs else None
        self._open[path] = entry  # most recently used last
        if len(self._open) > self.max_open_shards:
            self._open.popitem(last=False)
        return entry

    def _row(self, epoch: int, index: int, name: str) -> torch.Tensor:
        if not 0 <= index < self.n_clips:
            raise IndexError(f"index {index} out of range for a cache of {self.n_clips} clips")
        shard, row = divmod(index, self.shard_size)
        path = shard_path(self.directory, epoch % self.epochs, shard)
        handle, _, crcs = self._open_shard(path)
        value = handle.get_slice(name)[row]
        if name == "latents" and crcs is not None and row_crc32(value) != crcs[row]:
            raise VideoDataError(f"latent cache shard {path}, row {row} is damaged (checksum): {REBUILD_SHARDS}")
        return value

    def latents(self, epoch: int, index: int) -> torch.Tensor:
        """float32 [latent_frames, C, h, w] of sample ``index`` at ``epoch`` (modulo the cached epochs)."""
        return self._row(epoch, index, "latents").float()

    def clip(self, epoch: int, index: int) -> int:
        """The clip sample ``index`` actually used (another one when its own was bad)."""
        return int(self._row(epoch, index, "clips"))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": OrderedDict()}  # open shards do not pickle (spawned workers)


class CachedLatentDataset(EpochDataset):
    """A training dataset whose items also carry ``latents``, the cached reference latents
    of exactly their frames. ``training.data.loading.build_training_data`` wraps the training set
    once, with ``CachedLatentDataset.from_config(train_set, config)``.

    Epoch ``e`` draws the clips of cached epoch ``e % epochs``: ``set_epoch`` (called by the
    sampler each epoch) forwards that to the dataset, while ``epoch`` keeps the full count
    for the shuffle order. Latents are keyed by the requested index: a replaced clip's
    frames come from the requested index's random draws, which is what the cache encoded.
    """

    def __init__(self, dataset: VideoClipDataset, cache: LatentCache):
        if len(dataset) != cache.n_clips:
            raise UserError(
                f"the dataset has {len(dataset)} clips, latent cache {cache.directory} has "
                f"{cache.n_clips}: {VALIDITY_HELP}"
            )
        self.dataset = dataset
        self.cache = cache
        self._epoch = shared_epoch()  # the full count (the shuffle order), seen by workers
        self.set_epoch(dataset.epoch)

    @classmethod
    def from_config(cls, dataset: VideoClipDataset, config: TrainConfig) -> CachedLatentDataset:
        """Open ``config.latent_cache_dir`` and check that it matches ``config`` and ``dataset``."""
        cache = LatentCache(Path(config.latent_cache_dir))
        cache.check(config, len(dataset))
        return cls(dataset, cache)

    def __len__(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.dataset.set_epoch(epoch % self.cache.epochs)

    def __getitem__(self, index: int) -> dict:
        epoch = self.dataset.epoch
        if epoch >= self.cache.epochs:
            raise ValueError(
                f"the dataset draws epoch {epoch} but the cache holds epochs 0..{self.cache.epochs - 1}: "
                "set the epoch through CachedLatentDataset.set_epoch, not on the wrapped dataset"
            )
        item = self.dataset[index]
        cached_clip = self.cache.clip(epoch, index)
        if item["index"] != cached_clip:
            raise VideoDataError(
                f"sample {index} used clip {item['index']} but the cache encoded clip {cached_clip}: the videos "
                f"changed since the cache was built (a file became unreadable or was repaired); {VALIDITY_HELP}"
            )
        return {**item, "latents": self.cache.latents(epoch, index)}
