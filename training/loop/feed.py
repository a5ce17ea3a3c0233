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

import dataclasses
import functools
import logging
import math

import torch
from torch.utils.flop_counter import FlopCounterMode

from taehv_train.common.config import TrainConfig
from taehv_train.training.loop.losses import loss_plan, uses_reference
from taehv_train.training.loop.memory import meta_training_inputs

logger = logging.getLogger(__name__)

# output frames/s of one worker on random 17-frame windows of 720x480 H.264 clips
# (bench/bench_data.py on a 16-core H200 host: 98.8 alone, 89.7 each with 14 workers)
WORKER_FRAMES_PER_SECOND = 90.0
# share of the bf16 peak the TAE's training step reached: the 1gpu_h100 preset's plain
# step on an H200, 17.4 TFLOP per micro-batch in about 0.1 s
STEP_SHARE_OF_PEAK = 0.18
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class GpuPeak:
    """One GPU model's dense (no sparsity) bf16 tensor-core peak in FLOP/s, and the SMs and
    memory of the full part, which tell it from a MIG slice or another part of the same name."""

    family: str  # as printed
    bf16_flops: float
    sms: int
    memory_gb: int


# By the exact name torch.cuda.get_device_properties reports. Where a datasheet lists tensor-core
# figures with 2:4 sparsity only, the dense peak is half, written "sparse / 2". bf16 is counted
# with fp32 accumulation, as PyTorch runs it, and so is fp16 (same peak; GeForce cards' doubled
# fp16-accumulate rate does not apply). Every part's dense TF32 peak is half its bf16 one, on
# GeForce cards too, hence one PEAK_SHARE for all.
_GH200 = GpuPeak("GH200", 1979e12 / 2, 132, 96)
GPU_PEAKS: dict[str, GpuPeak] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM, PCIe, NVL); H800 datasheet (SXM, PCIe)
    "NVIDIA H100 80GB HBM3": GpuPeak("H100 SXM", 1979e12 / 2, 132, 80),
    "NVIDIA H100 PCIe": GpuPeak("H100 PCIe", 1513e12 / 2, 114, 80),
    "NVIDIA H100 NVL": GpuPeak("H100 NVL", 1671e12 / 2, 132, 94),
    "NVIDIA H800": GpuPeak("H800 SXM", 1979e12 / 2, 132, 80),
    "NVIDIA H800 PCIe": GpuPeak("H800 PCIe", 1513e12 / 2, 114, 80),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM, NVL)
    "NVIDIA H200": GpuPeak("H200", 1979e12 / 2, 132, 141),
    "NVIDIA H200 NVL": GpuPeak("H200 NVL", 1671e12 / 2, 132, 141),
    # NVIDIA GH200 Grace Hopper Superchip datasheet (96 GB HBM3 or 144 GB HBM3e; "480GB" and "120GB" are the CPU's)
    "NVIDIA GH200 480GB": _GH200,
    "NVIDIA GH200 120GB": _GH200,
    "NVIDIA GH200 144G HBM3e": dataclasses.replace(_GH200, memory_gb=144),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM and PCIe alike); A800 datasheet
    "NVIDIA A100-SXM4-80GB": GpuPeak("A100 SXM4 80GB", 312e12, 108, 80),
    "NVIDIA A100-SXM4-40GB": GpuPeak("A100 SXM4 40GB", 312e12, 108, 40),
    "NVIDIA A100 80GB PCIe": GpuPeak("A100 PCIe 80GB", 312e12, 108, 80),
    "NVIDIA A100-PCIE-40GB": GpuPeak("A100 PCIe 40GB", 312e12, 108, 40),
    "NVIDIA A800-SXM4-80GB": GpuPeak("A800 SXM4 80GB", 312e12, 108, 80),
    "NVIDIA A800-SXM4-40GB": GpuPeak("A800 SXM4 40GB", 312e12, 108, 40),
    "NVIDIA A800 80GB PCIe": GpuPeak("A800 PCIe 80GB", 312e12, 108, 80),
    # NVIDIA A10, A30 and A40 datasheets
    "NVIDIA A10": GpuPeak("A10", 125e12, 72, 24),
    "NVIDIA A30": GpuPeak("A30", 165e12, 56, 24),
    "NVIDIA A40": GpuPeak("A40", 149.7e12, 84, 48),
    # NVIDIA L40S, L40 and L4 datasheets (the L40 runs bf16 at half the L40S's rate)
    "NVIDIA L40S": GpuPeak("L40S", 362.05e12, 142, 48),
    "NVIDIA L40": GpuPeak("L40", 181.05e12, 142, 48),
    "NVIDIA L4": GpuPeak("L4", 242e12 / 2, 58, 24),
    # NVIDIA HGX B200 datasheet (per GPU)
    "NVIDIA B200": GpuPeak("B200", 4.5e15 / 2, 148, 180),
    # NVIDIA Ampere GA102 GPU Architecture whitepaper (bf16 with fp32 accumulation); the RTX 3090 Ti,
    # which it predates, at its per-SM rate and the 3090 Ti's 1.86 GHz boost clock
    "NVIDIA GeForce RTX 3090": GpuPeak("RTX 3090", 71e12, 82, 24),
    "NVIDIA GeForce RTX 3090 Ti": GpuPeak("RTX 3090 Ti", 80e12, 84, 24),
    "NVIDIA RTX A6000": GpuPeak("RTX A6000", 154.8e12, 84, 48),
    # NVIDIA Ada GPU Architecture whitepaper (bf16 with fp32 accumulation)
    "NVIDIA GeForce RTX 4090": GpuPeak("RTX 4090", 165.2e12, 128, 24),
    "NVIDIA RTX 6000 Ada Generation": GpuPeak("RTX 6000 Ada", 364.2e12, 142, 48),
    # NVIDIA RTX Blackwell GPU Architecture whitepaper (bf16 with fp32 accumulation)
    "NVIDIA GeForce RTX 5090": GpuPeak("RTX 5090", 209.5e12, 170, 32),
}
PEAK_SHARE = {"bf16": 1.0, "fp16": 1.0, "no": 0.5}  # of the bf16 peak, by mixed_precision: fp32 runs TF32


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
        loss_plan(config, uses_reference(config)).decode_own,
    )


def step_frames_per_second(config: TrainConfig, peak_flops: float) -> float:
    """Frames per second one GPU of ``peak_flops`` (bf16) trains on at ``config``'s micro-batch."""
    return config.train_batch_size * config.n_frames * STEP_SHARE_OF_PEAK * peak_flops / micro_batch_flops(config)


def identify_gpu(name: str, memory: int, sms: int) -> GpuPeak | None:
    """The peak of a GPU of ``name`` (as torch reports it), ``memory`` bytes and ``sms`` SMs;
    None when the name is not in ``GPU_PEAKS`` or the memory or SMs are not its part's, so
    that no MFU is divided by another part's peak.

    A MIG slice (" MIG <profile>" in the name, or fewer SMs than the full part) gets the
    full part's peak scaled by its share of the SMs: the tensor cores are per SM and run at
    the same clocks in a slice, so its MFU reads like a whole GPU's."""
    part = GPU_PEAKS.get(name.partition(" MIG ")[0])
    if part is None or sms > part.sms or memory > 1.1 * part.memory_gb * GIB:
        return None
    if " MIG " in name or sms < part.sms:
        family = f"{part.family} MIG slice ({sms} of {part.sms} SMs)"
        return dataclasses.replace(part, family=family, bf16_flops=part.bf16_flops * sms / part.sms)
    # ECC can hold back up to 1/16 of GDDR memory (an L40S reports 45 GiB of its 48)
    return part if memory >= 0.9 * part.memory_gb * GIB else None


@functools.cache
def _log_unknown_gpu(name: str, memory: int, sms: int) -> None:
    """Say once per process why MFU is missing, with what would identify the GPU."""
    logger.warning(
        "no MFU: %s (%.1f GiB, %d SMs) is not in the table of GPU peaks (training/loop/feed.py, GPU_PEAKS)",
        name,
        memory / GIB,
        sms,
    )


def local_gpu(index: int = 0) -> tuple[str, float] | None:
    """(family, bf16 peak FLOP/s) of this machine's GPU ``index`` (``identify_gpu``); None
    without CUDA or for an unknown GPU, which is logged once."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(index)
    gpu = identify_gpu(props.name, props.total_memory, props.multi_processor_count)
    if gpu is None:
        _log_unknown_gpu(props.name, props.total_memory, props.multi_processor_count)
        return None
    return gpu.family, gpu.bf16_flops


def peak_flops(device: torch.device, mixed_precision: str) -> float | None:
    """The dense tensor-core peak (FLOP/s) that training in ``mixed_precision`` can reach on
    ``device``; None on a CPU or an unknown GPU (MFU is then not reported)."""
    gpu = local_gpu(device.index or 0) if device.type == "cuda" else None
    return None if gpu is None else gpu[1] * PEAK_SHARE[mixed_precision]


def feed_notes(config: TrainConfig, gpu: tuple[str, float] | None = None) -> list[str]:
    """The step's frames/s per GPU against what ``dataloader_num_workers`` decode, as a note;
    a warning with the workers needed when they fall short. Nothing without a known GPU
    (``gpu``: (family, bf16 peak), by default this machine's) or in fp32 training."""
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
