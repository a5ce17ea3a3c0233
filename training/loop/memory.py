"""How much memory one training step needs, known before any data or weights load.

The TAE's forward pass is run on the ``meta`` device (shapes only: nothing is computed or
allocated) at the training size, with the block schedule this machine trains with (the
CPU training schedule, or the published blocks on a GPU), and the storages it keeps for
the backward pass are added up: the activations of one micro-batch, exactly as the training forward makes them
(both decodes when reference latents are used, no encoder activations when it is frozen).
Weights and optimizer state of a tiny TAE are small beside them; the reference VAE,
Seraena and LPIPS are not counted. A run whose activations alone exceed the device's
memory is refused before the run starts (the launch script's pre-flight, then training on
each node), with the number, instead of hanging in start-up or dying in its first step.
Frame caches (``frame_cache_mb`` per loader process) and prefetched batches whose sum over
this machine's processes exceeds its RAM are refused the same way, and so is fp16 mixed
precision without a GPU (it would train in fp32).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from taehv_train.base.errors import UserError, readable_size
from taehv_train.common.config import TrainConfig, native_bf16, spec_of
from taehv_train.models.taehv import TAEHV
from taehv_train.training.loop.library_seams import storage_key
from taehv_train.training.loop.losses import loss_plan, uses_reference

_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
CGROUP_MEMORY_LIMIT = Path("/sys/fs/cgroup/memory.max")
# peak of forward + backward over the kept activations: 1.30-1.37 (bench/bench_step_memory.py)
BACKWARD_PEAK = 1.4


def meta_training_inputs(
    variant: str, batch: int, frames: int, height: int, width: int, dtype: torch.dtype, with_reference: bool
) -> tuple[TAEHV, torch.Tensor, torch.Tensor | None]:
    """A TAE, ``batch`` clips and (``with_reference``) reference latents on the ``meta``
    device, for the training forward ``net(clips, reference, decode_own=...)``."""
    with torch.device("meta"):
        net = TAEHV(variant=variant).to(dtype)
    clips = torch.zeros(batch, frames, net.image_channels, height, width, device="meta", dtype=dtype)
    reference = None
    if with_reference:
        with torch.no_grad():
            reference = torch.zeros_like(net.encode_video(clips))
    return net, clips, reference


@functools.lru_cache(maxsize=8)
def activation_bytes(
    variant: str,
    batch: int,
    frames: int,
    height: int,
    width: int,
    dtype: torch.dtype,
    with_reference: bool,
    decode_own: bool,
    train_encoder: bool,
) -> int:
    """Bytes the training forward of ``batch`` clips keeps for the backward pass."""
    net, clips, reference = meta_training_inputs(variant, batch, frames, height, width, dtype, with_reference)
    net.encoder.requires_grad_(train_encoder)
    kept: dict[int, int] = {}  # by storage: a tensor saved by several operations counts once

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        kept[storage_key(tensor)] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        net(clips, reference, decode_own=decode_own)
    return sum(kept.values())


def step_bytes(config: TrainConfig) -> int:
    """The activations of one micro-batch of ``config``'s training."""
    return activation_bytes(
        config.variant,
        config.train_batch_size,
        config.n_frames,
        config.height,
        config.width,
        _HALF.get(config.mixed_precision, torch.float32),
        uses_reference(config),
        loss_plan(config, uses_reference(config)).decode_own,
        config.train_encoder,
    )


def host_memory() -> int:
    """Bytes of this machine's RAM, or of its cgroup limit when that is lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if CGROUP_MEMORY_LIMIT.is_file() and (limit := CGROUP_MEMORY_LIMIT.read_text().strip()).isdigit():
        total = min(total, int(limit))
    return total


def local_processes() -> int:
    """Training processes on this machine (set by the launcher; 1 without one)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def device_memory() -> tuple[str, int]:
    """(name, bytes) of the memory one training process may use: the first GPU's, else
    this machine's RAM (or its cgroup limit) shared by the processes on it."""
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        return f"the {properties.name}", properties.total_memory
    processes = local_processes()
    return (
        "this machine's RAM" if processes == 1 else f"this machine's RAM / {processes} processes"
    ), host_memory() // processes


def check_host_memory(config: TrainConfig) -> None:
    """Raise UserError when what the loaders hold could outgrow this machine's RAM: every
    loader process (each DataLoader worker, or the training process without workers) of
    every training process here fills its own frame cache up to ``frame_cache_mb``, and each
    training process keeps ``prefetch_batches`` batches received plus ``prefetch_factor``
    prepared by each worker. A typo such as 100000000 would end in the out-of-memory killer
    hours into a run."""
    workers, processes, available = config.dataloader_num_workers, local_processes(), host_memory()
    loaders = max(workers, 1)
    per_loader = config.frame_cache_mb << 20
    caches = per_loader * loaders * processes
    if caches > available:
        raise UserError(
            f"frame_cache_mb={config.frame_cache_mb} ({readable_size(per_loader)} per loader process) x {loaders} "
            f"loader process(es) (dataloader_num_workers) x {processes} training process(es) on this machine is "
            f"{readable_size(caches)}, more than its {readable_size(available)} of RAM: lower frame_cache_mb "
            f"well below {available // (loaders * processes) >> 20}, which alone would fill it (0 turns the cache off)"
        )
    batch = batch_bytes(config)
    prepared = workers * config.prefetch_factor  # batches the workers of one training process prepare ahead
    held = batch * (config.prefetch_batches + prepared) * processes
    if caches + held > available:
        fits = (available - caches) // (batch * processes) - prepared
        raise UserError(
            f"prefetch_batches={config.prefetch_batches} and prefetch_factor={config.prefetch_factor} x {workers} "
            f"dataloader_num_workers keep {config.prefetch_batches + prepared} batches of {readable_size(batch)} "
            f"per training process, x {processes} training process(es) on this machine: {readable_size(held)}, "
            + (f"which with the frame caches' {readable_size(caches)} is " if caches else "")
            + f"more than its {readable_size(available)} of RAM: "
            + (
                f"set prefetch_batches to at most {fits}"
                if fits >= 1
                else "lower frame_cache_mb, prefetch_factor, dataloader_num_workers or train_batch_size"
            )
        )


def batch_bytes(config: TrainConfig) -> int:
    """Bytes of one training batch as the loader delivers it: uint8 frames."""
    channels = spec_of(config).image_channels
    return config.train_batch_size * config.n_frames * channels * config.height * config.width


def check_precision(config: TrainConfig) -> None:
    """Raise UserError for ``mixed_precision=fp16`` without a GPU: Accelerate has no fp16
    autocast on a CPU and would train in fp32 while the run says fp16."""
    if config.mixed_precision == "fp16" and not torch.cuda.is_available():
        bf16 = "native on this CPU" if native_bf16() else "emulated on this CPU: slower than no"
        raise UserError(
            f"mixed_precision=fp16 needs a GPU: on a CPU it would train in fp32; use mixed_precision=bf16 "
            f"({bf16}) or no"
        )


def _describe(config: TrainConfig, needed: int) -> str:
    return (
        f"one training step keeps about {readable_size(needed)} of activations ({config.train_batch_size} "
        f"clip(s) of {config.n_frames} frames at {config.height}x{config.width}, {config.variant}, "
        f"{config.mixed_precision if config.mixed_precision in _HALF else 'fp32'})"
    )


def check_fits(config: TrainConfig) -> list[str]:
    """Raise UserError when one step's activations alone exceed the device's memory;
    else the estimate as a note for the log (a warning when the backward pass's peak may
    not fit). The launch script's pre-flight and training call it on the machine that
    trains; ``training.preflight.check`` stays a property of the config alone. The precision
    (``check_precision``) and what the loaders hold in this machine's RAM (``check_host_memory``)
    are checked first."""
    check_precision(config)
    check_host_memory(config)
    where, available = device_memory()
    needed = step_bytes(config)
    if needed > available:
        raise UserError(
            f"{_describe(config, needed)}, more than the {readable_size(available)} of {where}: lower "
            "height and width (the training crop), n_frames or train_batch_size "
            "(gradient_accumulation_steps keeps the effective batch)"
        )
    warning = (
        f"; the backward pass peaks about {BACKWARD_PEAK:g}x higher, so it may run out of memory: consider a "
        "smaller crop, fewer frames or a smaller batch"
        if needed * BACKWARD_PEAK > available
        else ""
    )
    return [f"{_describe(config, needed)}; {where} has {readable_size(available)}{warning}"]
