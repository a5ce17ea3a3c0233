#!/usr/bin/env python3
"""Training loader throughput from the same clips as files, as local tar shards, and as tar
shards served over the S3 API on loopback; prints JSON.

    python -m bench.bench_shards --videos_dir ../shared/videos --clips 24 --workers 1 4 8

The clips are the shared videos re-encoded at 720x480 H.264 (``bench/lib/reencoded_clips.py``),
copied under other names up to ``--clips`` files, and packed by the tool users run,
``make_annotations --to_shards`` (``--shard_size``, all clips on the training side). The
three sources are read by the training loader as a run builds it (``VideoClipDataset`` in
train mode at the training defaults: 17 frames at 720x480, strides 1-3, crops of 0.6-1.0
of the area, flips; ``build_dataloader``, batch size 1, the shard order for shards):

- ``files``: an annotation of the clip files;
- ``local_shards``: the shards on the same disk;
- ``s3_shards``: the same shards in a bucket of moto's S3 server on loopback
  (``bench/lib/s3_loopback.py``), read through s3fs by byte range.

Each row times ``--samples`` clips after ``workers + 1`` of warm-up (worker start-up, first
opens) and is the median of ``--repeats`` rounds; the sources take turns within each round,
so they see the same machine load. Loopback has no network latency or bandwidth limit: the
S3 rows measure the client's and the S3 API's own cost per request, not a real network.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from bench.lib.harness import command_line, machine_info, print_json, shared_dir, utc_now
from bench.lib.reencoded_clips import reencode_clips
from bench.lib.s3_loopback import MotoServer, S3Bucket, client_environment
from taehv_train.common.clips import VideoClipDataset
from taehv_train.common.config import TrainConfig
from taehv_train.training import make_annotations
from taehv_train.training.data.clip_loader import build_dataloader


def make_sources(videos_dir: Path, work: Path, clips: int, shard_size: str, bucket: S3Bucket) -> dict[str, str]:
    """The three sources of the same ``clips`` clip files."""
    reencoded = work / "reencoded"
    entries = reencode_clips(videos_dir, reencoded, 720, 480)
    files = work / "clips"
    files.mkdir()
    listed = []
    for n in range(clips):
        entry = entries[n % len(entries)]
        name = f"clip{n:04d}.mp4"
        shutil.copyfile(reencoded / entry["path"], files / name)
        listed.append({"full_path": str(files / name), "frames": entry["frames"]})
    annotation = work / "files.json"
    annotation.write_text(json.dumps({"total": len(listed), "list": listed}))
    shards = work / "shards"
    args = [str(files), "--to_shards", str(shards), "--shard_size", shard_size, "--val_fraction", "0"]
    if make_annotations.main([*args, "-o", str(work / "annotations.json")], train_line=False) != 0:
        raise RuntimeError("make_annotations --to_shards failed")
    for path in sorted((shards / "train").iterdir()):
        bucket.put(f"shards/train/{path.name}", path.read_bytes())
    return {
        "files": str(annotation),
        "local_shards": f"{shards}/train/*.tar",
        "s3_shards": bucket.url("shards/train/*.tar"),
    }


def dataset_of(source: str) -> VideoClipDataset:
    """The training set of ``source`` at the training defaults."""
    defaults = TrainConfig()
    return VideoClipDataset(
        None,
        source,
        n_frames=defaults.n_frames,
        height=defaults.height,
        width=defaults.width,
        stride_range=(defaults.stride_min, defaults.stride_max),
        crop_scale=(defaults.crop_scale_min, defaults.crop_scale_max),
        mode="train",
        seed=0,
    )


def clips_per_second(dataset: VideoClipDataset, workers: int, samples: int) -> float:
    """Clips/s of the training loader over ``samples`` clips after ``workers + 1`` of warm-up,
    epoch after epoch as training reads them."""
    loader = build_dataloader(dataset, batch_size=1, num_workers=workers, seed=0)

    def epochs() -> Iterator[dict]:
        for epoch in itertools.count():
            dataset.set_epoch(epoch)
            yield from loader

    batches = epochs()
    for _ in range(workers + 1):
        next(batches)
    start = time.perf_counter()
    for _ in range(samples):
        next(batches)
    elapsed = time.perf_counter() - start
    batches.close()  # ends the epoch's iteration and with it the workers
    return samples / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--videos_dir", type=Path, default=shared_dir() / "videos")
    parser.add_argument("--clips", type=int, default=24)
    parser.add_argument("--shard_size", default="16MB")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument(
        "--samples",
        type=int,
        default=96,
        help="clips timed per row: whole epochs of --clips keep the mix of clips the same for every source",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = MotoServer(work)
        try:
            os.environ.update(client_environment(server.endpoint, work))  # the loader workers inherit it
            os.environ["TAEHV_SHARD_INDEX_CACHE"] = str(work / "index_cache")
            bucket = S3Bucket(server, "clips", dict(os.environ))
            sources = make_sources(args.videos_dir, work, args.clips, args.shard_size, bucket)
            datasets = {name: dataset_of(source) for name, source in sources.items()}
            rounds: dict[tuple[str, int], list[float]] = {}
            for _ in range(args.repeats):
                for workers in args.workers:
                    for name, dataset in datasets.items():
                        rate = clips_per_second(dataset, workers, args.samples)
                        rounds.setdefault((name, workers), []).append(rate)
        finally:
            server.stop()

    rows = []
    for workers in args.workers:
        rate = {name: statistics.median(rounds[(name, workers)]) for name in datasets}
        rows.append(
            {
                "workers": workers,
                "clips_per_s": {name: round(value, 2) for name, value in rate.items()},
                "spread": {name: [round(v, 2) for v in rounds[(name, workers)]] for name in datasets},
                "local_shards_vs_files": round(rate["local_shards"] / rate["files"], 3),
                "s3_vs_local_shards": round(rate["s3_shards"] / rate["local_shards"], 3),
            }
        )
    report = {
        "command": command_line("bench.bench_shards"),
        "date": utc_now(),
        "machine": machine_info(),
        "clips": args.clips,
        "shard_size": args.shard_size,
        "samples": args.samples,
        "repeats": args.repeats,
        "sample": "17 frames at 720x480 from 720x480 H.264, strides 1-3, crops 0.6-1.0, batch size 1",
        "rows": rows,
    }
    print_json(report, out=args.out)


if __name__ == "__main__":
    main()
