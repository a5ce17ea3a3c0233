"""Whether the DataLoader workers can feed one GPU's training step, estimated before the run.

One GPU's step consumes frames at a rate its arithmetic sets: the training forward's FLOPs
are counted on the ``meta`` device (``torch.utils.flop_counter``, shapes only), tripled for
the backward pass, and divided by the share of the GPU's bf16 peak that the TAE's step was
measured to reach. One loader worker decodes the sampler's random windows at a measured
rate. Both measurements are in docs/data.md ("A million clips"). The estimate sizes
``dataloader_num_workers``; it cannot know the clips' resolution or the host's cores, so
the launch script's pre-flight and training only note it, and warn when the workers
cannot keep up.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.utils.flop_counter import FlopCounterMode

from common.config import TrainConfig
from training.loop.memory import decodes_own_latents, meta_training_inputs, uses_reference

# output frames/s of one worker on random 17-frame windows of 720x480 H.264 clips
# (bench/bench_data.py on a 16-core H200 host: 98.8 alone, 89.7 each with 14 workers)
WORKER_FRAMES_PER_SECOND = 90.0
# share of the bf16 peak the TAE's training step reached: the 1gpu_h100 preset's plain
# step on an H200, 17.4 TFLOP per micro-batch in about 0.1 s
STEP_SHARE_OF_PEAK = 0.18
# dense bf16 tensor-core peaks (FLOP/s) by a name fragment of torch.cuda.get_device_name (SXM parts);
# fp16's is the same, and fp32 training runs its convolutions in TF32 (cuDNN's default in PyTorch), at half
BF16_PEAK = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12}
PEAK_SHARE = {"bf16": 1.0, "fp16": 1.0, "no": 0.5}  # of the bf16 peak, by mixed_precision


@functools.lru_cache(maxsize=8)
def forward_flops(
    variant: str,
    batch: int,
    frames: int,
    height: int,
    width: int,
    with_reference: bool,
    decode_own: bool,
) -> int:
    """FLOPs of the training forward of ``batch`` clips (bf16 shapes on the meta device)."""
    net, clips, reference = meta_training_inputs(variant, batch, frames, height, width, torch.bfloat16, with_reference)
    with FlopCounterMode(display=False) as counter:
        net(clips, reference, decode_own=decode_own)
    return counter.get_total_flops()


def micro_batch_flops(config: TrainConfig) -> int:
    """FLOPs of one micro-batch's training forward and backward pass (the backward counted
    as twice the forward; Seraena's discriminator and the reference VAE not included)."""
    return 3 * forward_flops(
        config.variant,
        config.train_batch_size,
        config.n_frames,
        config.height,
        config.width,
        uses_reference(config),
        decodes_own_latents(config),
    )


def step_frames_per_second(config: TrainConfig, peak_flops: float) -> float:
    """Frames per second one GPU of ``peak_flops`` (bf16) trains on at ``config``'s micro-batch."""
    return config.train_batch_size * config.n_frames * STEP_SHARE_OF_PEAK * peak_flops / micro_batch_flops(config)


def local_gpu(index: int = 0) -> tuple[str, float] | None:
    """(name, bf16 peak FLOP/s) of this machine's GPU ``index``, when it is one of ``BF16_PEAK``."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(index)
    return next(((name, peak) for fragment, peak in BF16_PEAK.items() if fragment in name), None)


def peak_flops(device: torch.device, mixed_precision: str) -> float | None:
    """The dense tensor-core peak (FLOP/s) that training in ``mixed_precision`` can reach on
    ``device``; None on a CPU or an unknown GPU (MFU is then not reported)."""
    gpu = local_gpu(device.index or 0) if device.type == "cuda" else None
    return None if gpu is None else gpu[1] * PEAK_SHARE[mixed_precision]


def feed_notes(config: TrainConfig, gpu: tuple[str, float] | None = None) -> list[str]:
    """The step's frames/s per GPU against what ``dataloader_num_workers`` decode, as a note;
    a warning with the workers needed when they fall short. Nothing without a known GPU
    (``gpu``: (name, bf16 peak), by default this machine's) or in fp32 training."""
    gpu = gpu or local_gpu()
    if gpu is None or config.mixed_precision not in ("bf16", "fp16"):
        return []
    name, peak = gpu
    consumed = step_frames_per_second(config, peak)
    workers = config.dataloader_num_workers
    supplied = workers * WORKER_FRAMES_PER_SECOND
    needed = math.ceil(consumed / WORKER_FRAMES_PER_SECOND)
    estimate = (
        f"one {name}'s training step takes about {consumed:.0f} frames/s "
        f"({STEP_SHARE_OF_PEAK:.0%} of its bf16 peak) and {workers} loader worker(s) decode about "
        f"{supplied:.0f} (~{WORKER_FRAMES_PER_SECOND:.0f} each from 720x480 clips)"
    )
    if workers >= needed:
        return [estimate]
    return [
        f"the loader may not keep up: {estimate}: set dataloader_num_workers={needed} or more per GPU; with "
        "fewer cores, cut clips to n_frames frames with short keyframe intervals, lower stride_max, or cache "
        "decoded frames (frame_cache_mb) (docs/data.md, 'A million clips')"
    ]
