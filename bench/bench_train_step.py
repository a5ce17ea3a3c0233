#!/usr/bin/env python3
"""Training-step cost: a full step against the bare forward+backward of the autoencoder;
prints one JSON object.

    python -m tools.make_reference_vae /tmp/cvx2b           # CogVideoX-2b architecture, random weights
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
import sys

import torch

from bench.lib.harness import command_line, device_label, print_json, threads_summary
from bench.lib.step_builder import train_step
from taehv_train.base.flags import ArgumentParser
from taehv_train.common.config import TrainConfig
from taehv_train.common.reference_vae import ReferenceVAE
from taehv_train.evaluation.timing import median_seconds
from taehv_train.models.taehv import TAEHV
from taehv_train.training.data.loading import ReferenceLatents
from taehv_train.training.loop.step import TrainStep


def forward_backward(step: TrainStep, frames: torch.Tensor, z_ref: torch.Tensor) -> None:
    """Forward, losses and backward of the same step, nothing else."""
    step.accelerator.backward(step.forward(frames, z_ref).losses["loss"])
    step.optimizer.zero_grad(set_to_none=True)


def main() -> None:
    with contextlib.redirect_stdout(sys.stderr):  # libraries' log lines (DeepSpeed's) stay out of the JSON
        result = run()
    print_json(result)


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
    parser.add_argument("--ref_vae", default="", help="diffusers folder (tools/make_reference_vae.py) for 'online'")
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
        "machine": threads_summary(),
        "device": device_label(device),
        "torch": torch.__version__,
        "command": command_line(),
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
