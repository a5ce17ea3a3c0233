"""Build the reference-latent cache: encode the training clips with the frozen reference VAE once.

    python -m taehv_train.training.build_latent_cache --config training/configs/taehv_config_h100.py [--key=value ...]
        [--output DIR] [--shard_size 256] [--dtype bf16|fp32] [--batch_size N] [--num_workers N]
    accelerate launch --num_processes 8 -m taehv_train.training.build_latent_cache --config ...
        # (rank r: shards k % 8 == r)

The reference VAE dominates a distillation step; with its latents on disk, training costs
what plain autoencoder training costs. What the cache holds and how training reads it:
``training.data.latent_cache`` and docs/latent_cache.md. Shards are written atomically, so an
existing shard is complete and a rerun skips it. A full disk ends the build in one line
(exit status 2): the shards written, about what the rest needs, and the command to re-run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from taehv_train.base.atomic import atomic_write
from taehv_train.base.errors import UserError, exit_on_user_error, readable_size
from taehv_train.base.flags import ArgumentParser
from taehv_train.base.process_exit import exit_without_teardown
from taehv_train.common.clips import VideoClipDataset, frames_to_unit
from taehv_train.common.config import TrainConfig, load_config, resolve_path
from taehv_train.common.lifeline import end_with_launcher
from taehv_train.common.reference_vae import ReferenceVAE
from taehv_train.training.data.latent_cache import (
    CACHE_MANIFEST,
    FORMAT_VERSION,
    ROW_CRC32,
    LatentCache,
    differences,
    latent_sample_generator,
    read_cache_manifest,
    row_crc32,
    shard_path,
    validity,
)
from taehv_train.training.data.loading import build_datasets
from taehv_train.training.loop.distributed import process_state, started_command
from taehv_train.training.preflight import check
from taehv_train.training.state.atomic_folders import DiskFullError, is_disk_full

logger = logging.getLogger(__name__)

STORAGE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def make_manifest(config: TrainConfig, n_clips: int, shard_size: int, dtype: str) -> dict:
    return {
        "format": FORMAT_VERSION,
        "valid_for": validity(config, n_clips),
        "storage": {"shard_size": shard_size, "dtype": dtype},
    }


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
        return (
            f"latent cache {self.directory}: {self.clips} clips x {self.epochs} epoch(s) in {self.shards} shards, "
            f"{self.size_bytes / 2**20:.1f} MiB; this process computed {self.computed_shards} shard(s), "
            f"{self.computed_clips} clips in {self.seconds:.1f} s ({rate:.2f} clips/s)"
        )


def _check_options(config: TrainConfig, shard_size: int, dtype: str, batch_size: int) -> None:
    if not config.ref_vae_path:
        raise UserError(
            "the latent cache holds the reference VAE's latents: set ref_vae_path (in the config or "
            "with --ref_vae_path=DIR, a diffusers model folder)"
        )
    if shard_size < 1 or batch_size < 1:
        raise UserError(f"--shard_size and --batch_size must be >= 1, got {shard_size} and {batch_size}")
    if dtype not in STORAGE_DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(STORAGE_DTYPES)}, got {dtype!r}")
    check(config.replace(latent_cache_dir=""))  # the cache folder need not exist yet


def _check_folder(output: Path, manifest: dict) -> None:
    """A rerun continues a cache only if it was made for the same settings."""
    existing = read_cache_manifest(output)
    if existing is None:
        if output.is_dir() and any(output.iterdir()):
            raise UserError(f"{output} is not empty and holds no {CACHE_MANIFEST}: choose an empty or new folder")
        return
    mismatches = differences(
        {**existing["valid_for"], **existing["storage"], "format": existing.get("format")},
        {**manifest["valid_for"], **manifest["storage"], "format": manifest["format"]},
    )
    if mismatches:
        raise UserError(
            f"{output} holds a latent cache made with other settings ({'; '.join(mismatches)}): "
            f"use another --output folder, or delete {output} to rebuild it"
        )


def _write_shard(path: Path, latents: list[torch.Tensor], clips: list[int], rank: int) -> None:
    """Atomically: a shard that exists is complete, whatever kills the process. Each row's
    CRC-32 goes in the metadata, so training detects a damaged row when it reads it."""
    rows = torch.stack(latents).contiguous()
    atomic_write(
        path,
        safetensors.torch.save(
            {"latents": rows, "clips": torch.tensor(clips, dtype=torch.int64)},
            metadata={"rank": str(rank), ROW_CRC32: ",".join(map(str, map(row_crc32, rows)))},
        ),
    )


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
        loader = DataLoader(
            requests,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            **({"prefetch_factor": self.prefetch_factor} if self.num_workers else {}),
        )
        pending = iter(shards)
        shard, rows, clips = next(pending), [], []
        for batch in loader:
            generators = None
            if self.vae.sample:  # diffusers draws the noise of row j with generators[j]
                generators = [latent_sample_generator(self.seed, epoch, i) for i in batch["requested"].tolist()]
            frames = frames_to_unit(batch["frames"], self.device)
            latents = self.vae.encode(frames, generators).to(self.dtype).cpu()
            for row, clip in zip(latents, batch["index"].tolist()):
                rows.append(row)
                clips.append(clip)
                if len(rows) == len(self.indices(shard)):
                    _write_shard(shard_path(self.output, epoch, shard), rows, clips, self.rank)
                    progress.update(1)
                    shard, rows, clips = next(pending, None), [], []


def build_cache(
    config: TrainConfig,
    output: str | Path,
    shard_size: int = 256,
    dtype: str = "bf16",
    batch_size: int = 1,
    num_workers: int = 0,
) -> CacheSummary:
    """Compute the missing shards of this process (``k % world_size == rank``) for every
    cached epoch; the main process writes the manifest first and checks completeness last.
    Settings are checked before any process group exists, so mistakes fail fast everywhere."""
    output = resolve_path(str(output))
    _check_options(config, shard_size, dtype, batch_size)
    dataset = build_datasets(config)[0]
    manifest = make_manifest(config, len(dataset), shard_size, dtype)
    _check_folder(output, manifest)

    state = process_state()
    vae = ReferenceVAE.from_config(config, state.device)
    dataset.probe()  # a broken dataset stops here, not after hours of encoding
    if state.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
        if read_cache_manifest(output) is None:
            atomic_write(output / CACHE_MANIFEST, json.dumps(manifest, indent=1))
    state.wait_for_everyone()

    encoder = _Encoder(
        vae,
        dataset,
        output,
        shard_size,
        STORAGE_DTYPES[dtype],
        config.seed,
        batch_size,
        num_workers,
        config.prefetch_factor,
        state.device,
        state.process_index,
    )
    n_shards = math.ceil(len(dataset) / shard_size)
    mine = {
        epoch: [
            k
            for k in range(n_shards)
            if k % state.num_processes == state.process_index and not shard_path(output, epoch, k).is_file()
        ]
        for epoch in range(config.latent_cache_epochs)
    }
    todo = sum(len(shards) for shards in mine.values())
    clips = sum(len(encoder.indices(k)) for shards in mine.values() for k in shards)
    logger.info(
        "%s: %d clips x %d epoch(s), %d shards per epoch; rank %d computes %d missing shard(s) (%d clips)",
        output,
        len(dataset),
        config.latent_cache_epochs,
        n_shards,
        state.process_index,
        todo,
        clips,
    )
    start = time.perf_counter()
    with tqdm(total=todo, desc="latent shards", unit="shard", disable=not state.is_local_main_process) as progress:
        for epoch, shards in mine.items():
            if shards:
                encoder.encode_epoch(epoch, shards, progress)
    seconds = time.perf_counter() - start
    logger.info(
        "rank %d: %d clips in %.1f s (%.2f clips/s)",
        state.process_index,
        clips,
        seconds,
        clips / seconds if seconds > 0 else 0.0,
    )
    state.wait_for_everyone()

    missing = LatentCache(output).missing_shards()
    if missing:
        raise RuntimeError(f"{len(missing)} shard(s) still missing after every rank finished (e.g. {missing[0]})")
    size = sum(p.stat().st_size for p in output.glob("epoch*/shard*.safetensors"))
    summary = CacheSummary(
        output,
        len(dataset),
        config.latent_cache_epochs,
        n_shards * config.latent_cache_epochs,
        todo,
        clips,
        seconds,
        size,
    )
    logger.info("%s", summary)
    return summary


# ----------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> CacheSummary:
    """The CLI: options of the builder, everything else ``--key=value`` config overrides."""
    parser = ArgumentParser(
        description="Precompute reference-VAE latents of the training clips "
        "(docs/latent_cache.md). Other --key=value arguments override the config.",
        allow_abbrev=False,
    )
    parser.add_argument("--config", required=True, help="Python config file defining `config`")
    parser.add_argument("--output", default=None, help="cache folder (default: the config's latent_cache_dir)")
    parser.add_argument("--shard_size", type=int, default=256, help="consecutive samples per shard file")
    parser.add_argument("--dtype", default="bf16", choices=sorted(STORAGE_DTYPES), help="storage dtype of the latents")
    parser.add_argument(
        "--batch_size",
        type=int,
        default=None,
        help="clips per reference-VAE call (default: train_batch_size, which fits in training)",
    )
    parser.add_argument(
        "--num_workers", type=int, default=None, help="DataLoader decoding processes (default: dataloader_num_workers)"
    )
    args, overrides = parser.parse_known_args(argv)
    config = load_config(args.config, overrides)
    output = args.output or config.latent_cache_dir
    if not output:
        raise UserError("no cache folder: pass --output DIR or set latent_cache_dir in the config")
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
    )
    try:
        return build_cache(
            config,
            output,
            args.shard_size,
            args.dtype,
            config.train_batch_size if args.batch_size is None else args.batch_size,
            config.dataloader_num_workers if args.num_workers is None else args.num_workers,
        )
    except Exception as err:
        if not is_disk_full(err):
            raise
        rerun = started_command("taehv_train.training.build_latent_cache", sys.argv[1:] if argv is None else argv)
        raise full_disk_error(resolve_path(output), rerun) from err


def full_disk_error(output: Path, rerun: list[str]) -> DiskFullError:
    """A full disk while building: what is written (complete shards only: a shard's partial
    file is removed), about what the rest needs, what is free, and the command that goes on
    from there once there is room."""
    written, missing = [], []
    if read_cache_manifest(output) is not None:
        for path in LatentCache(output).shard_paths():
            (written if path.is_file() else missing).append(path)
    state = "no shard is written"
    if written:
        needed = len(missing) * max(path.stat().st_size for path in written)
        state = (
            f"{len(written)} of {len(written) + len(missing)} shards are written, the other {len(missing)} need "
            f"about {readable_size(needed)}"
        )
    folder = next(p for p in (output, *output.parents) if p.exists())
    return DiskFullError(
        f"no space left on the device of {output} for the latent cache: {state}, "
        f"{readable_size(shutil.disk_usage(folder).free)} are free. Free space there, then re-run (it keeps the "
        f"written shards): {shlex.join(rerun)}"
    )


def entry_point(argv: list[str] | None = None) -> None:
    exit_on_user_error(main, argv)


if __name__ == "__main__":
    end_with_launcher()  # under accelerate launch, each rank ends with the launcher
    with exit_without_teardown():
        entry_point()
