#!/usr/bin/env python3
"""What the checkpoint checksums cost: the time to save a full training checkpoint (model,
AdamW state, EMA, RNG, fp32 export), the part of it spent computing the CRC-32 of every
file, and the time to verify them before a resume; prints one JSON object.

    python -m bench.bench_checkpoint --variants taecvx taew2_2 --repeats 3

One process on the CPU, the checkpoint written to ``--dir`` (default: a temporary folder;
put it on the file system your runs use). Each figure is the median of ``--repeats``
saves of a fresh step; files come from the page cache when they are verified, as they do
right after a save.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
from pathlib import Path

import torch
from accelerate import Accelerator
from diffusers.training_utils import EMAModel

from bench.lib.harness import cpu_name, print_json, timed
from taehv_train.base.flags import ArgumentParser
from taehv_train.common.run_files import read_checkpoint_manifest
from taehv_train.models.taehv import TAEHV
from taehv_train.training.loop.resilience import FaultPlan
from taehv_train.training.state.checkpoints import TrainingObjects, save_checkpoint


def measure(variant: str, directory: Path, repeats: int) -> dict:
    accelerator = Accelerator(cpu=True)
    model = TAEHV(variant=variant)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.ConstantLR(optimizer, 1.0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    for p in model.parameters():  # Adam moments exist after a first step
        p.grad = torch.randn_like(p)
    optimizer.step()
    ema = EMAModel([p.detach().float() for p in model.parameters()])
    objects = TrainingObjects(accelerator, model, optimizer, scheduler, ema, torch.Generator())
    saves, checksums, verifies, sizes = [], [], [], []
    for step in range(1, repeats + 1):
        seconds, path = timed(
            functools.partial(
                save_checkpoint,
                objects,
                directory,
                step,
                keep=1,
                trainer_state={"step": step},
                faults=FaultPlan(),
            )
        )
        saves.append(seconds)
        manifest = read_checkpoint_manifest(path)
        checksums.append(manifest["checksum_seconds"])
        sizes.append(sum(entry["size"] for entry in manifest["files"].values()))
        verifies.append(timed(functools.partial(read_checkpoint_manifest, path, verify_checksums=True))[0])
    save_s, checksum_s = statistics.median(saves), statistics.median(checksums)
    return {
        "variant": variant,
        "parameters_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "checkpoint_mb": sizes[-1] / 2**20,
        "save_s": save_s,
        "checksum_s": checksum_s,
        "checksum_share_of_save": checksum_s / save_s,
        "verify_s": statistics.median(verifies),
        "checksum_gb_per_s": sizes[-1] / 2**30 / checksum_s,
    }


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["taecvx", "taew2_2"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        runs = [measure(variant, Path(folder) / variant, args.repeats) for variant in args.variants]
    machine = {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    print_json({"benchmark": "checkpoint", "machine": machine, "runs": runs}, indent=2)


if __name__ == "__main__":
    main()
