#!/usr/bin/env python3
"""Training-step cost: a full step against the bare forward+backward of the autoencoder;
prints one JSON object.

    python -m bench.make_reference_vae /tmp/cvx2b           # CogVideoX-2b architecture, random weights
    python -m bench.bench_train_step --ref_vae /tmp/cvx2b --height 64 --width 64 --frames 9
    python -m bench.bench_train_step --device cuda --ref_vae /tmp/cvx2b --height 480 --width 720 --frames 17

Scenarios, each timed as the median of ``--repeats`` steps after ``--warmup`` steps on one
in-memory batch (data loading is measured by bench/bench_data.py), synchronised on CUDA:

- ``bare``: the autoencoder's forward pass on the batch and its reference latents, the
  recipe's losses and the backward pass; nothing else.
- ``cached`` / ``none``: the product's training step (``training.loop.step.TrainStep``, the
  object the training loop calls) with reference latents in the batch, as the latent
  cache delivers them / without a reference VAE: normalisation, forward, losses, the
  cross-rank agreement, backward, gradient clipping, optimizer, scheduler and EMA steps;
  optionally with Seraena.
- ``online``: the same step with the reference VAE encoding the batch (``--ref_vae``).

One process; ``ratio_to_bare`` is the step time over ``bare``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

from common.config import TrainConfig
from common.flags import ArgumentParser
from common.reference_vae import ReferenceVAE
from evaluation.timing import median_seconds
from models.taehv import TAEHV
from training.data.loading import ReferenceLatents
from training.loop.step import TrainStep, accumulation_plugin


def build_step(
    config: TrainConfig, device: torch.device, latents: ReferenceLatents, loader: DataLoader | None = None
) -> tuple[TrainStep, DataLoader | None]:
    """The training loop's step, built the way the loop builds it (one process), and the
    training ``loader`` prepared with it; its windows are ``config``'s
    ``gradient_accumulation_steps`` micro-batches, and on CUDA the prepared loader copies its
    pinned batches to the GPU asynchronously, as in training (``make_accelerator``)."""
    accelerator = Accelerator(
        cpu=device.type == "cpu",
        mixed_precision=config.mixed_precision,
        gradient_accumulation_plugin=accumulation_plugin(config),
        dataloader_config=DataLoaderConfiguration(non_blocking=device.type == "cuda"),
    )
    step, loader = TrainStep.build(config, accelerator, TAEHV(variant=config.variant), latents, loader=loader)
    step.model.train()
    return step, loader


def train_step(config: TrainConfig, device: torch.device, latents: ReferenceLatents, seraena: bool) -> TrainStep:
    """``build_step`` without a loader (batches handed to the step), with or without Seraena."""
    return build_step(config.replace(use_seraena=seraena), device, latents)[0]


def forward_backward(step: TrainStep, frames: torch.Tensor, z_ref: torch.Tensor) -> None:
    """Forward, losses and backward of the same step, nothing else."""
    step.accelerator.backward(step.forward(frames, z_ref).losses["loss"])
    step.optimizer.zero_grad(set_to_none=True)


def main() -> None:
    with contextlib.redirect_stdout(sys.stderr):  # libraries' log lines (DeepSpeed's) stay out of the JSON
        result = run()
    print(json.dumps(result, indent=1))


def run() -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variant", default="taecvx")
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--n_seraena_frames", type=int, default=3)
    parser.add_argument("--seraena_buffer", type=int, default=1024)
    parser.add_argument("--ref_vae", default="", help="diffusers folder (bench/make_reference_vae.py) for 'online'")
    parser.add_argument("--mixed_precision", default=None, help="no | bf16 (default: bf16 on CUDA, no on CPU)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    precision = args.mixed_precision or ("bf16" if device.type == "cuda" else "no")
    config = TrainConfig(
        variant=args.variant,
        n_frames=args.frames,
        height=args.height,
        width=args.width,
        train_batch_size=args.batch,
        mixed_precision=precision,
        n_seraena_frames=args.n_seraena_frames,
        seraena_buffer_size=args.seraena_buffer,
        learning_rate=1e-4,
        compile="false",  # eager against eager (bench_compile measures compiling)
    )
    torch.manual_seed(0)
    frames = torch.randint(0, 256, (args.batch, args.frames, 3, args.height, args.width), dtype=torch.uint8)
    unit = frames.to(device).float().div(255)
    ref_vae = None
    if args.ref_vae:
        ref_vae = ReferenceVAE(args.ref_vae, dtype="bf16" if device.type == "cuda" else "fp32", device=device)
        z_ref = ref_vae.encode(unit)
    else:  # latents of the right shape stand in for the cache
        model = TAEHV(variant=args.variant)
        size = (args.height // (8 * model.patch_size), args.width // (8 * model.patch_size))
        z_ref = torch.randn(
            args.batch, model.plan(args.frames).latent_frames, model.latent_channels, *size, device=device
        )
    cached_batch = {"frames": frames, "latents": z_ref}
    plain_batch = {"frames": frames}
    cache, no_reference = ReferenceLatents(None, cached=True), ReferenceLatents(None, cached=False)

    rows = []

    def record(name: str, seraena: bool, run, warmup: int = args.warmup) -> None:
        seconds, _ = median_seconds(run, device, warmup, args.repeats)
        rows.append(
            {
                "scenario": name,
                "seraena": seraena,
                "step_s": round(seconds, 4),
                "samples_per_s": round(args.batch / seconds, 2),
            }
        )

    def steps(step: TrainStep, batch: dict):
        windows = iter(range(1, 1 << 30))
        return lambda: step(iter([batch]), next(windows))  # a window of one micro-batch

    cached = train_step(config, device, cache, seraena=False)
    record("bare", False, lambda: forward_backward(cached, unit, z_ref))
    record("cached", False, steps(cached, cached_batch))
    record("none", False, steps(train_step(config, device, no_reference, seraena=False), plain_batch))
    if ref_vae is not None:
        online = train_step(config, device, ReferenceLatents(ref_vae, cached=False), seraena=False)
        record("online", False, steps(online, plain_batch), warmup=1)
    record("cached", True, steps(train_step(config, device, cache, seraena=True), cached_batch))
    record("none", True, steps(train_step(config, device, no_reference, seraena=True), plain_batch))
    bare = rows[0]["step_s"]
    for row in rows:
        row["ratio_to_bare"] = round(row["step_s"] / bare, 3)
    return {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "variant": args.variant,
        "frames": args.frames,
        "height": args.height,
        "width": args.width,
        "batch": args.batch,
        "mixed_precision": precision,
        "reference_vae": args.ref_vae or None,
        "steps": rows,
    }


if __name__ == "__main__":
    main()
