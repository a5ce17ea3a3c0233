"""Reference-latent cache: encode the training clips with the frozen reference VAE once.

    python -m training.cache_latents --config training/configs/taehv_config_h100.py [--key=value ...]
        [--output DIR] [--shard_size 256] [--dtype bf16|fp32] [--batch_size N] [--num_workers N]
    accelerate launch --num_processes 8 -m training.cache_latents --config ...   # rank r: shards k % 8 == r

The reference VAE dominates a distillation step; with its latents on disk, training costs
what plain autoencoder training costs. The dataset draws every sample from
``(seed, epoch, index)``, so the latents of ``dataset[index]`` at ``epoch`` are a fixed
tensor: the cache stores them for epochs ``0 .. latent_cache_epochs - 1`` and training
reuses epoch ``e % latent_cache_epochs`` (``CachedLatentDataset``). Sampled latents use a
generator seeded per sample (``latent_sample_generator``), so a cache does not depend on
batching, sharding, the number of processes or restarts.

Layout (docs/latent_cache.md): ``manifest.json`` (what the cache is valid for) and
``epoch{e:03d}/shard{k:06d}.safetensors``, each holding ``latents`` [n, T', C, h, w] and
``clips`` [n] (the clip each sample actually used) for indices ``k * shard_size`` onwards.
Shards are written atomically, so an existing shard is complete and a rerun skips it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from safetensors import safe_open
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from models.variants import get_variant
from training.config import ConfigError, TrainConfig, check, exit_on_config_error, load_config, resolve_path
from training.dataset import VideoClipDataset, VideoDataError
from training.distributed import process_state
from training.utils import ReferenceVAE

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
STORAGE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SAMPLING_STREAM = 0x1A7E  # keeps the latent noise stream apart from the dataset's (seed, epoch, index) draws
VALIDITY_HELP = ("rebuild it with `python -m training.cache_latents --config <this config>`, or set "
                 "latent_cache_dir='' to compute reference latents online")


def latent_sample_generator(seed: int, epoch: int, index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator for ``latent_dist.sample()`` of sample ``index`` at ``epoch``: one per
    sample, so its noise depends on nothing but (seed, epoch, index). The cache builder uses
    CPU generators, whose stream is the same on every machine (CUDA's differs)."""
    state = np.random.SeedSequence([seed, epoch, index, SAMPLING_STREAM]).generate_state(1, np.uint64)[0]
    return torch.Generator(device).manual_seed(int(state))


def shard_path(directory: Path, epoch: int, shard: int) -> Path:
    """Where shard ``shard`` (indices ``shard * shard_size`` onwards) of ``epoch`` lives."""
    return directory / f"epoch{epoch:03d}" / f"shard{shard:06d}.safetensors"


def _file_digest(path: str) -> str:
    """sha256 of an annotation file: the same name with other clips is another dataset."""
    resolved = resolve_path(path) if path else None
    if resolved is None or not resolved.is_file():
        return ""
    return hashlib.sha256(resolved.read_bytes()).hexdigest()


def validity(config: TrainConfig, n_clips: int) -> dict:
    """Every setting that changes the cached latents: the frames (data and its random
    draws) and the reference VAE. Two configs with the same validity share a cache."""
    return {
        "data_root": str(resolve_path(config.data_root)) if config.data_root else "",
        "annotation_file": str(resolve_path(config.annotation_file)) if config.annotation_file else "",
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
        "ref_vae_path": str(resolve_path(config.ref_vae_path)) if config.ref_vae_path else "",
        "ref_vae_class": config.ref_vae_class,
        "ref_vae_subfolder": config.ref_vae_subfolder,
        "ref_vae_dtype": config.ref_vae_dtype,
        "ref_latent_sample": config.ref_latent_sample,
        "latent_channels": get_variant(config.variant).latent_channels,
        "epochs": config.latent_cache_epochs,
    }


def make_manifest(config: TrainConfig, n_clips: int, shard_size: int, dtype: str) -> dict:
    return {"format": FORMAT_VERSION, "valid_for": validity(config, n_clips),
            "storage": {"shard_size": shard_size, "dtype": dtype}}


def differences(cached: dict, wanted: dict) -> list[str]:
    """``key: cache X, now Y`` for every key whose value differs."""
    return [f"{key}: cache {cached.get(key)!r}, now {wanted.get(key)!r}"
            for key in sorted(set(cached) | set(wanted)) if cached.get(key) != wanted.get(key)]


def read_manifest(directory: Path) -> dict | None:
    path = directory / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


# ----------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------


class LatentCache:
    """Read access to a cache folder: ``latents(epoch, index)`` from lazily opened,
    memory-mapped shards (only the requested row is read)."""

    max_open_shards = 32  # bounded: a long run touches thousands of shards

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        manifest = read_manifest(self.directory)
        if manifest is None:
            raise ConfigError(f"{self.directory} is not a latent cache (no {MANIFEST}); build it with "
                              "`python -m training.cache_latents --config <config> --output DIR`")
        if manifest.get("format") != FORMAT_VERSION:
            raise ConfigError(f"latent cache {self.directory} has format {manifest.get('format')}, this code reads "
                              f"format {FORMAT_VERSION}: {VALIDITY_HELP}")
        self.manifest = manifest
        self.epochs: int = manifest["valid_for"]["epochs"]
        self.n_clips: int = manifest["valid_for"]["n_clips"]
        self.shard_size: int = manifest["storage"]["shard_size"]
        self._open: OrderedDict[Path, object] = OrderedDict()

    @property
    def n_shards(self) -> int:
        return math.ceil(self.n_clips / self.shard_size)

    def missing_shards(self) -> list[Path]:
        return [path for epoch in range(self.epochs) for shard in range(self.n_shards)
                if not (path := shard_path(self.directory, epoch, shard)).is_file()]

    def check(self, config: TrainConfig, n_clips: int) -> None:
        """Raise ConfigError unless this cache holds the latents ``config`` would compute
        for a dataset of ``n_clips`` clips, for every cached epoch."""
        mismatches = differences(self.manifest["valid_for"], validity(config, n_clips))
        if mismatches:
            raise ConfigError(f"latent cache {self.directory} was made for other settings:\n  "
                              + "\n  ".join(mismatches) + f"\n{VALIDITY_HELP}")
        missing = self.missing_shards()
        if missing:
            raise ConfigError(f"latent cache {self.directory} is incomplete: {len(missing)} shard(s) missing "
                              f"(e.g. {missing[0]}); rerun `python -m training.cache_latents` with the same "
                              "settings to finish it")

    def _row(self, epoch: int, index: int, name: str) -> torch.Tensor:
        if not 0 <= index < self.n_clips:
            raise IndexError(f"index {index} out of range for a cache of {self.n_clips} clips")
        shard, row = divmod(index, self.shard_size)
        path = shard_path(self.directory, epoch % self.epochs, shard)
        handle = self._open.pop(path, None) or safe_open(str(path), framework="pt")
        self._open[path] = handle  # most recently used last
        if len(self._open) > self.max_open_shards:
            self._open.popitem(last=False)
        return handle.get_slice(name)[row]

    def latents(self, epoch: int, index: int) -> torch.Tensor:
        """float32 [latent_frames, C, h, w] of sample ``index`` at ``epoch`` (modulo the cached epochs)."""
        return self._row(epoch, index, "latents").float()

    def clip(self, epoch: int, index: int) -> int:
        """The clip sample ``index`` actually used (another one when its own was bad)."""
        return int(self._row(epoch, index, "clips"))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": OrderedDict()}  # open shards do not pickle (spawned workers)


class CachedLatentDataset(Dataset):
    """A training dataset whose items also carry ``latents``, the cached reference latents
    of exactly their frames. Training wraps its dataset once:

        train_set = CachedLatentDataset.from_config(train_set, config)  # then z_ref = batch["latents"]

    Epoch ``e`` draws the clips of cached epoch ``e % epochs``: ``set_epoch`` (called by the
    sampler each epoch) forwards that to the dataset, while ``epoch`` keeps the full count
    for the shuffle order. Latents are keyed by the requested index: a replaced clip's
    frames come from the requested index's random draws, which is what the cache encoded.
    """

    def __init__(self, dataset: VideoClipDataset, cache: LatentCache):
        if len(dataset) != cache.n_clips:
            raise ConfigError(f"the dataset has {len(dataset)} clips, latent cache {cache.directory} has "
                              f"{cache.n_clips}: {VALIDITY_HELP}")
        self.dataset = dataset
        self.cache = cache
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()  # like the dataset's, seen by workers
        self.set_epoch(dataset.epoch)

    @classmethod
    def from_config(cls, dataset: VideoClipDataset, config: TrainConfig) -> CachedLatentDataset:
        """Open ``config.latent_cache_dir`` and check that it matches ``config`` and ``dataset``."""
        cache = LatentCache(resolve_path(config.latent_cache_dir))
        cache.check(config, len(dataset))
        return cls(dataset, cache)

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)
        self.dataset.set_epoch(epoch % self.cache.epochs)

    def __getitem__(self, index: int) -> dict:
        epoch = self.dataset.epoch
        if epoch >= self.cache.epochs:
            raise ValueError(f"the dataset draws epoch {epoch} but the cache holds epochs 0..{self.cache.epochs - 1}: "
                             "set the epoch through CachedLatentDataset.set_epoch, not on the wrapped dataset")
        item = self.dataset[index]
        cached_clip = self.cache.clip(epoch, index)
        if item["index"] != cached_clip:
            raise VideoDataError(
                f"sample {index} used clip {item['index']} but the cache encoded clip {cached_clip}: the videos "
                f"changed since the cache was built (a file became unreadable or was repaired); {VALIDITY_HELP}")
        return {**item, "latents": self.cache.latents(epoch, index)}


# ----------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------


class _Requests(Dataset):
    """Dataset items at chosen indices, with the requested index (which keys the cache
    and seeds the noise) next to the item's own ``index`` (the clip used)."""

    def __init__(self, dataset: VideoClipDataset, indices: list[int]):
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int) -> dict:
        index = self.indices[position]
        return {**self.dataset[index], "requested": index}


@dataclass
class CacheSummary:
    """What a run of the builder did, for its closing log line."""

    directory: Path
    clips: int
    epochs: int
    shards: int
    computed_shards: int  # by this process in this run
    computed_clips: int
    seconds: float
    size_bytes: int

    def __str__(self) -> str:
        rate = self.computed_clips / self.seconds if self.seconds > 0 else 0.0
        return (f"latent cache {self.directory}: {self.clips} clips x {self.epochs} epoch(s) in {self.shards} shards, "
                f"{self.size_bytes / 2**20:.1f} MiB; this process computed {self.computed_shards} shard(s), "
                f"{self.computed_clips} clips in {self.seconds:.1f} s ({rate:.2f} clips/s)")


def _check_options(config: TrainConfig, shard_size: int, dtype: str, batch_size: int) -> None:
    if not config.ref_vae_path:
        raise ConfigError("the latent cache holds the reference VAE's latents: set ref_vae_path (in the config or "
                          "with --ref_vae_path=DIR, a diffusers model folder)")
    if shard_size < 1 or batch_size < 1:
        raise ConfigError(f"--shard_size and --batch_size must be >= 1, got {shard_size} and {batch_size}")
    if dtype not in STORAGE_DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(STORAGE_DTYPES)}, got {dtype!r}")
    check(config.replace(latent_cache_dir=""))  # the cache folder need not exist yet


def _check_folder(output: Path, manifest: dict) -> None:
    """A rerun continues a cache only if it was made for the same settings."""
    existing = read_manifest(output)
    if existing is None:
        if output.is_dir() and any(output.iterdir()):
            raise ConfigError(f"{output} is not empty and holds no {MANIFEST}: choose an empty or new folder")
        return
    mismatches = differences({**existing["valid_for"], **existing["storage"], "format": existing.get("format")},
                             {**manifest["valid_for"], **manifest["storage"], "format": manifest["format"]})
    if mismatches:
        raise ConfigError(f"{output} holds a latent cache made with other settings:\n  " + "\n  ".join(mismatches)
                          + f"\nuse another --output folder, or delete {output} to rebuild it")


def _write_json_atomically(path: Path, data: dict) -> None:
    tmp = path.with_name(TMP_PREFIX + path.name)
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _write_shard(path: Path, latents: list[torch.Tensor], clips: list[int], rank: int) -> None:
    """tmp file, fsync, rename: a shard that exists is complete, whatever kills the process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(TMP_PREFIX + path.name)
    data = safetensors.torch.save({"latents": torch.stack(latents).contiguous(),
                                   "clips": torch.tensor(clips, dtype=torch.int64)}, metadata={"rank": str(rank)})
    with open(tmp, "wb") as f:  # not save_file: it creates 0600 files, and a cache is often shared
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class _Encoder:
    """Encodes samples of one epoch into shards; what stays fixed for the whole run."""

    vae: ReferenceVAE
    dataset: VideoClipDataset
    output: Path
    shard_size: int
    dtype: torch.dtype
    seed: int
    batch_size: int
    num_workers: int
    prefetch_factor: int
    device: torch.device
    rank: int

    def indices(self, shard: int) -> range:
        return range(shard * self.shard_size, min((shard + 1) * self.shard_size, len(self.dataset)))

    def encode_epoch(self, epoch: int, shards: list[int], progress: tqdm) -> None:
        """Encode the samples of ``shards`` in batches and write each shard as soon as its
        last sample is encoded (a batch may straddle two shards)."""
        self.dataset.set_epoch(epoch)  # before the workers start: they read the dataset's epoch
        requests = _Requests(self.dataset, [i for k in shards for i in self.indices(k)])
        loader = DataLoader(requests, batch_size=self.batch_size, num_workers=self.num_workers,
                            **({"prefetch_factor": self.prefetch_factor} if self.num_workers else {}))
        pending = iter(shards)
        shard, rows, clips = next(pending), [], []
        for batch in loader:
            generators = None
            if self.vae.sample:  # diffusers draws the noise of row j with generators[j]
                generators = [latent_sample_generator(self.seed, epoch, i) for i in batch["requested"].tolist()]
            frames = batch["frames"].to(self.device, non_blocking=True).float().div_(255)
            latents = self.vae.encode(frames, generators).to(self.dtype).cpu()
            for row, clip in zip(latents, batch["index"].tolist()):
                rows.append(row)
                clips.append(clip)
                if len(rows) == len(self.indices(shard)):
                    _write_shard(shard_path(self.output, epoch, shard), rows, clips, self.rank)
                    progress.update(1)
                    shard, rows, clips = next(pending, None), [], []


def build_cache(config: TrainConfig, output: str | Path, shard_size: int = 256, dtype: str = "bf16",
                batch_size: int = 1, num_workers: int = 0) -> CacheSummary:
    """Compute the missing shards of this process (``k % world_size == rank``) for every
    cached epoch; the main process writes the manifest first and checks completeness last.
    Settings are checked before any process group exists, so mistakes fail fast everywhere."""
    from training.taehv_train import build_datasets  # here: taehv_train imports this module

    output = resolve_path(str(output))
    _check_options(config, shard_size, dtype, batch_size)
    dataset = build_datasets(config)[0]
    manifest = make_manifest(config, len(dataset), shard_size, dtype)
    _check_folder(output, manifest)

    state = process_state()
    vae = ReferenceVAE(resolve_path(config.ref_vae_path), config.ref_vae_class, config.ref_vae_subfolder,
                       config.ref_vae_dtype, state.device, config.ref_latent_sample)
    if vae.latent_channels != manifest["valid_for"]["latent_channels"]:
        raise ConfigError(f"the reference VAE has {vae.latent_channels} latent channels but {config.variant} has "
                          f"{manifest['valid_for']['latent_channels']}: pick the matching variant")
    dataset.validate()  # a broken dataset stops here, not after hours of encoding
    if state.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
        if read_manifest(output) is None:
            _write_json_atomically(output / MANIFEST, manifest)
    state.wait_for_everyone()

    encoder = _Encoder(vae, dataset, output, shard_size, STORAGE_DTYPES[dtype], config.seed, batch_size, num_workers,
                       config.prefetch_factor, state.device, state.process_index)
    n_shards = math.ceil(len(dataset) / shard_size)
    mine = {epoch: [k for k in range(n_shards) if k % state.num_processes == state.process_index
                    and not shard_path(output, epoch, k).is_file()] for epoch in range(config.latent_cache_epochs)}
    todo = sum(len(shards) for shards in mine.values())
    clips = sum(len(encoder.indices(k)) for shards in mine.values() for k in shards)
    logger.info("%s: %d clips x %d epoch(s), %d shards per epoch; rank %d computes %d missing shard(s) (%d clips)",
                output, len(dataset), config.latent_cache_epochs, n_shards, state.process_index, todo, clips)
    start = time.perf_counter()
    with tqdm(total=todo, desc="latent shards", unit="shard", disable=not state.is_local_main_process) as progress:
        for epoch, shards in mine.items():
            if shards:
                encoder.encode_epoch(epoch, shards, progress)
    seconds = time.perf_counter() - start
    logger.info("rank %d: %d clips in %.1f s (%.2f clips/s)", state.process_index, clips, seconds,
                clips / seconds if seconds > 0 else 0.0)
    state.wait_for_everyone()

    missing = LatentCache(output).missing_shards()
    if missing:
        raise RuntimeError(f"{len(missing)} shard(s) still missing after every rank finished (e.g. {missing[0]})")
    size = sum(p.stat().st_size for p in output.glob("epoch*/shard*.safetensors"))
    summary = CacheSummary(output, len(dataset), config.latent_cache_epochs, n_shards * config.latent_cache_epochs,
                           todo, clips, seconds, size)
    logger.info("%s", summary)
    return summary


# ----------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> CacheSummary:
    """The CLI: options of the builder, everything else ``--key=value`` config overrides."""
    parser = argparse.ArgumentParser(description="Precompute reference-VAE latents of the training clips "
                                     "(docs/latent_cache.md). Other --key=value arguments override the config.",
                                     allow_abbrev=False)
    parser.add_argument("--config", required=True, help="Python config file defining `config`")
    parser.add_argument("--output", default=None, help="cache folder (default: the config's latent_cache_dir)")
    parser.add_argument("--shard_size", type=int, default=256, help="consecutive samples per shard file")
    parser.add_argument("--dtype", default="bf16", choices=sorted(STORAGE_DTYPES), help="storage dtype of the latents")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="clips per reference-VAE call (default: train_batch_size, which fits in training)")
    parser.add_argument("--num_workers", type=int, default=None,
                        help="DataLoader decoding processes (default: dataloader_num_workers)")
    args, overrides = parser.parse_known_args(argv)
    config = load_config(args.config, overrides)
    output = args.output or config.latent_cache_dir
    if not output:
        raise ConfigError("no cache folder: pass --output DIR or set latent_cache_dir in the config")
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    return build_cache(config, output, args.shard_size, args.dtype,
                       config.train_batch_size if args.batch_size is None else args.batch_size,
                       config.dataloader_num_workers if args.num_workers is None else args.num_workers)


def entry_point(argv: list[str] | None = None) -> None:
    exit_on_config_error(lambda: main(argv))


if __name__ == "__main__":
    entry_point()
