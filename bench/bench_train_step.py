#!/usr/bin/env python3
"""Training-step cost: a full step against the bare forward+backward of the autoencoder;
prints one JSON object.

    python bench/make_reference_vae.py /tmp/cvx2b           # CogVideoX-2b architecture, random weights
    python bench/bench_train_step.py --ref-vae /tmp/cvx2b --height 64 --width 64 --frames 9
    python bench/bench_train_step.py --device cuda --ref-vae /tmp/cvx2b --height 480 --width 720 --frames 17

Scenarios, each timed as the median of ``--repeats`` steps after ``--warmup`` steps on one
in-memory batch (data loading is measured by bench/bench_data.py), synchronised on CUDA:

- ``bare``: the autoencoder's forward pass on the batch and its reference latents, the
  recipe's losses and the backward pass; nothing else.
- ``cached`` / ``none``: the loop's full step with reference latents already in the batch
  (as the latent cache delivers them) / without a reference VAE: forward, losses, the
  cross-rank finiteness agreement, backward, gradient clipping, optimizer and scheduler
  step, EMA update; optionally with Seraena.
- ``online``: the same with the reference VAE encoding the batch first (``--ref-vae``).

The step is assembled from the training loop's own pieces (``training_forward``,
``add_seraena_loss``, ``agree``), one process; ``ratio_to_bare`` is the step time over
``bare``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accelerate import Accelerator  # noqa: E402
from diffusers.optimization import get_scheduler  # noqa: E402
from diffusers.training_utils import EMAModel  # noqa: E402

from models.taehv import TAEHV  # noqa: E402
from training.adversarial import build_seraena  # noqa: E402
from training.config import TrainConfig  # noqa: E402
from training.resilience import agree, is_finite_number  # noqa: E402
from training.taehv_train import add_seraena_loss, training_forward  # noqa: E402
from training.utils import ReferenceVAE  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Bench:
    """One model, optimizer, scheduler and EMA, prepared by Accelerate like training's."""

    def __init__(self, config: TrainConfig, device: torch.device, seraena: bool):
        self.config = config.replace(use_seraena=seraena)
        self.accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision=config.mixed_precision)
        model = TAEHV(variant=config.variant)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, betas=(0.9, 0.95))
        scheduler = get_scheduler("constant", optimizer)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.net = self.accelerator.unwrap_model(self.model)
        self.ema = EMAModel([p.detach().float() for p in self.net.parameters()], decay=0.999)
        self.ema.to(self.accelerator.device)
        self.seraena = build_seraena(self.config, self.net, self.accelerator.device) if seraena else None
        self.dtype = next(self.net.parameters()).dtype

    def bare(self, frames: torch.Tensor, z_ref: torch.Tensor | None) -> None:
        losses = training_forward(self.accelerator, self.model, frames, z_ref, self.config, self.dtype).losses
        self.accelerator.backward(losses["loss"])
        self.optimizer.zero_grad(set_to_none=True)

    def full(self, frames: torch.Tensor, z_ref: torch.Tensor | None) -> None:
        forward = training_forward(self.accelerator, self.model, frames, z_ref, self.config, self.dtype)
        agree([False, not bool(torch.isfinite(forward.losses["loss"])), False], self.accelerator.device)
        if self.seraena is not None:
            add_seraena_loss(forward, self.seraena, z_ref, self.config)
        self.accelerator.backward(forward.losses["loss"])
        grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm or math.inf)
        if is_finite_number(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.ema.step(self.net.parameters())


def main() -> None:
    with contextlib.redirect_stdout(sys.stderr):  # libraries' log lines (DeepSpeed's) stay out of the JSON
        result = run()
    print(json.dumps(result, indent=1))


def run() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variant", default="taecvx")
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--n-seraena-frames", type=int, default=3)
    parser.add_argument("--seraena-buffer", type=int, default=1024)
    parser.add_argument("--ref-vae", default="", help="diffusers folder (bench/make_reference_vae.py) for 'online'")
    parser.add_argument("--mixed-precision", default=None, help="no | bf16 (default: bf16 on CUDA, no on CPU)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    precision = args.mixed_precision or ("bf16" if device.type == "cuda" else "no")
    config = TrainConfig(variant=args.variant, n_frames=args.frames, height=args.height, width=args.width,
                         train_batch_size=args.batch, mixed_precision=precision, n_seraena_frames=args.n_seraena_frames,
                         seraena_buffer_size=args.seraena_buffer, learning_rate=1e-4)
    torch.manual_seed(0)
    frames = torch.rand(args.batch, args.frames, 3, args.height, args.width, device=device)
    ref_vae = None
    if args.ref_vae:
        ref_vae = ReferenceVAE(args.ref_vae, dtype="bf16" if device.type == "cuda" else "fp32", device=device)
        z_ref = ref_vae.encode(frames)
    else:  # latents of the right shape stand in for the cache
        plan = TAEHV(variant=args.variant).plan(args.frames)
        z_ref = torch.randn(args.batch, plan.latent_frames, 16, args.height // 8, args.width // 8, device=device)

    rows = []

    def record(name: str, seraena: bool, seconds: float) -> None:
        rows.append({"scenario": name, "seraena": seraena, "step_s": round(seconds, 4),
                     "samples_per_s": round(args.batch / seconds, 2)})

    plain = Bench(config, device, seraena=False)
    record("bare", False, timed(lambda: plain.bare(frames, z_ref), device, args.warmup, args.repeats))
    record("cached", False, timed(lambda: plain.full(frames, z_ref), device, args.warmup, args.repeats))
    record("none", False, timed(lambda: plain.full(frames, None), device, args.warmup, args.repeats))
    if ref_vae is not None:
        record("online", False, timed(lambda: plain.full(frames, ref_vae.encode(frames)), device, 1, args.repeats))
    adversarial = Bench(config, device, seraena=True)
    record("cached", True, timed(lambda: adversarial.full(frames, z_ref), device, args.warmup, args.repeats))
    record("none", True, timed(lambda: adversarial.full(frames, None), device, args.warmup, args.repeats))
    bare = rows[0]["step_s"]
    for row in rows:
        row["ratio_to_bare"] = round(row["step_s"] / bare, 3)
    return {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "variant": args.variant, "frames": args.frames, "height": args.height, "width": args.width,
        "batch": args.batch, "mixed_precision": precision, "reference_vae": args.ref_vae or None,
        "steps": rows,
    }


if __name__ == "__main__":
    main()
