"""CPU fast paths of the block runner: fused oneDNN inference and the CPU training schedule.

A block sequence's CPU paths (``CpuPaths``: its two schedules, or none for a sequence
whose nonlinearity is not ReLU) are made once, when the model is built (``prepare``);
``models.taehv.run_blocks`` asks ``choose`` once per run which of them the run's input
takes and hands it the whole run (``FastPath.run``); None means the published blocks,
each block's ``forward``: on GPUs, for inference under ``torch.compile``, and on CPU for
inference in other dtypes or under autocast. The fast paths compute the published function (within
float rounding) with fewer operations (their operations: ``models.fast_ops``):

* fused inference (``fused_schedule``), on CPU for fp32 input and weights, no autocast,
  eager, no gradient wanted: each convolution is one oneDNN call with its bias, ReLU and
  residual fused (``mkldnn._convolution_pointwise``, what inductor emits on CPU),
  channels-last; the encoder's first stage runs in row bands that stay in cache
  (``stem``); a TPool and the bias-free conv after it are one conv per frame of the group
  (``pool_conv``); an Upsample(2), a TGrow and a 3x3 conv are the TGrow at low resolution,
  then four 2x2 sub-pixel convs (``upsample_conv``).
* CPU training (``training_steps``), on CPU with gradients, eager or compiled: the same
  TPool and upsampling folds as differentiable ops, the derived weights made inside
  autograd so the gradients reach the published parameters (a full-resolution 1x1
  convolution's backward pass is slow on CPU).

What they bypass: memory blocks, TPools, and the convolutions and ReLUs folded into a
step are not called (their weights are), so forward hooks on them do not fire on these
paths; blocks left on their own (TGrow, PixelShuffle, Clamp, ...) still run their ``forward``.
Both fold ReLUs (a memory block's too), so blocks with another nonlinearity (lighttaehy1_5's
LeakyReLU) take the published blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn as nn

from .blocks import MEMORY_BLOCKS, RunOptions, Stops, TGrow, TPool, Work, find_stops
from .fast_ops import OneDNN, conv_act, forward_stacked, parity_major, pool_conv, stem, upsample_conv, with_past

_ONEDNN_POINTWISE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_convolution_pointwise")


class Kind(Enum):
    """What a step of a fast path's schedule runs."""

    FORWARD = "forward"  # the block's own forward: block(x)
    MEMORY = "memory"  # a memory block, its ReLUs and residual folded into its convs (forward_stacked)
    CONV = "conv"  # a conv and (``relu``) the ReLU after it
    UPSAMPLE_CONV = "upsample_conv"  # Upsample(2) (its TGrow run first, at low resolution), 3x3 conv
    POOL_CONV = "pool_conv"  # a TPool and the bias-free conv after it
    STEM = "stem"  # the encoder's conv, ReLU, TPool and stride-2 conv


@dataclass(frozen=True)
class Step:
    """One step of a schedule: ``kind``, from ``blocks[index]`` on."""

    index: int
    kind: Kind = Kind.FORWARD
    relu: bool = False  # the ReLU after the step's last conv is folded in
    parity_major: bool = False  # POOL_CONV: frame k of every group of frames is the k-th block of the input


MIXING_KINDS = (Kind.MEMORY, Kind.POOL_CONV, Kind.STEM)  # steps that mix frames (so do TPools and TGrows)


def block_step(index: int, block: nn.Module) -> Step:
    """The step that runs one block alone."""
    return Step(index, Kind.MEMORY if isinstance(block, MEMORY_BLOCKS) else Kind.FORWARD)


@dataclass(frozen=True)
class Schedule:
    """A fast path's steps over a block sequence (made once per sequence)."""

    steps: list[Step]
    stops: Stops
    parity_stride: int = 0  # frames laid out parity-major for the first TPool (0: not)


def make_schedule(blocks: nn.Sequential, steps: list[Step], parity_stride: int = 0) -> Schedule:
    stops = find_stops([blocks[step.index] for step in steps], [step.kind in MIXING_KINDS for step in steps])
    return Schedule(steps, stops, parity_stride)


@dataclass(frozen=True)
class FastPath:
    """A run's fast path: fused inference (``onednn`` set) or CPU training (None)."""

    schedule: Schedule
    onednn: OneDNN | None = None

    def layout(self, x: torch.Tensor) -> torch.Tensor:
        """A chunk's NTCHW frames as the (N*T)CHW input of the first step."""
        if self.schedule.parity_stride:
            return parity_major(x, self.schedule.parity_stride)
        x = x.flatten(0, 1)
        return x.contiguous(memory_format=torch.channels_last) if self.onednn is not None else x

    def run(
        self, blocks: nn.Sequential, x: torch.Tensor, memory: Sequence[torch.Tensor | None] | None, options: RunOptions
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """``models.taehv.run_blocks`` on this path's steps."""
        steps, onednn, n = self.schedule.steps, self.onednn, x.shape[0]
        work = Work(blocks, x, memory, self.schedule.stops, self.layout, options)
        while (item := work.take()) is not None:
            x, start, stop = item
            for step in steps[start:stop]:
                block = blocks[step.index]
                if step.kind is Kind.MEMORY:
                    x = forward_stacked(block, x, with_past(x, n, work.carry(step.index, x)), onednn)
                elif step.kind is Kind.FORWARD:
                    x = block(x)
                elif step.kind is Kind.CONV:
                    x = conv_act(block, x, onednn, step.relu)
                elif step.kind is Kind.UPSAMPLE_CONV:
                    x = upsample_conv(block, x, onednn, step.relu)
                elif step.kind is Kind.POOL_CONV:
                    x = pool_conv(block, blocks[step.index + 1], x, onednn, step.parity_major)
                else:
                    x = stem(block, blocks[step.index + 2], blocks[step.index + 3], x, onednn)
            work.put(x, stop)
        return work.result()


@dataclass(frozen=True)
class CpuPaths:
    """A block sequence's CPU fast paths (``prepare``): the fused inference schedule and
    the CPU training path."""

    fused: Schedule
    training: FastPath


_PATHS = "_cpu_paths"  # the attribute of a block sequence holding its CpuPaths (None: it has none)


def prepare(blocks: nn.Sequential) -> CpuPaths | None:
    """``blocks``' CPU paths, made once per sequence (``models.taehv.TAEHV`` at build, a
    bare sequence at its first run): None when a nonlinearity other than ReLU, which
    every fast path folds, is among its blocks."""
    if _PATHS not in blocks.__dict__:
        paths = None
        if not any(isinstance(m, nn.LeakyReLU) for m in blocks.modules()):
            paths = CpuPaths(fused_schedule(blocks), FastPath(make_schedule(blocks, training_steps(blocks))))
        blocks.__dict__[_PATHS] = paths
    return blocks.__dict__[_PATHS]


def choose(blocks: nn.Sequential, x: torch.Tensor, onednn: OneDNN | None, keep_weights: bool) -> FastPath | None:
    """The fast path of a run of ``blocks`` on the NTCHW frames ``x``, or None (the
    published blocks): what the run's input, grad mode, dtypes and autocast allow of the
    sequence's paths. ``onednn``: the fused path's state when it outlives the run (a
    stream), else one is made that keeps derived weights for the run if ``keep_weights``."""
    paths = prepare(blocks)
    if paths is None:
        return None
    if fused_path(x, blocks):
        return FastPath(paths.fused, onednn or OneDNN(keep_weights))
    if cpu_training(x, blocks):
        return paths.training
    return None


def fused_path(x: torch.Tensor, blocks: nn.Module) -> bool:
    """Whether a run of ``blocks`` on ``x`` takes the fused oneDNN path: CPU, fp32 input
    and weights, no autocast, eager, and no gradient wanted (grad mode off, or neither
    input nor weights require it)."""
    if not (_ONEDNN_POINTWISE and x.device.type == "cpu" and x.dtype == torch.float32) or torch.compiler.is_compiling():
        return False
    if torch.is_autocast_enabled("cpu") or any(p.dtype != torch.float32 for p in blocks.parameters()):
        return False
    return not wants_grad(x, blocks)


def cpu_training(x: torch.Tensor, blocks: nn.Module) -> bool:
    """Whether a run takes ``training_steps``: with gradients on a CPU (on GPUs the
    published blocks are faster). A shape-only run on the ``meta`` device (the pre-flight's
    memory estimate) takes the schedule this machine would train with."""
    device = x.device.type
    if device == "meta":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device == "cpu" and wants_grad(x, blocks)


def wants_grad(x: torch.Tensor, blocks: nn.Module) -> bool:
    """Whether a run of ``blocks`` on ``x`` records gradients."""
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in blocks.parameters()))


# ---------------------------------------------------------------------------------------
# Schedules, made once per block sequence (``prepare``).


def fused_schedule(blocks: nn.Sequential) -> Schedule:
    """The fused path's schedule for ``blocks``: the steps, and the stride for
    a parity-major input layout (0: none). Convolutions take the ReLU that follows; a TPool and
    the bias-free conv after it become ``pool_conv`` (the first one, if only convs and
    ReLUs precede it, reads a parity-major input without strides); an Upsample(2), a TGrow
    and a 3x3 conv become the TGrow at low resolution (1x1 convs commute with nearest
    upsampling), then ``upsample_conv``."""
    parity_stride, steps = 0, []
    kinds = [type(b) for b in blocks]

    def at(j: int, *types: type) -> bool:
        return all(j + k < len(blocks) and issubclass(kinds[j + k], t) for k, t in enumerate(types))

    i = 0
    if at(0, nn.Conv2d, nn.ReLU, TPool, nn.Conv2d) and _stem_fits(blocks[3]):
        parity_stride = blocks[2].stride
        steps.append(Step(0, Kind.STEM))
        i = 4
    while i < len(blocks):
        block = blocks[i]
        if at(i, TPool, nn.Conv2d) and blocks[i + 1].bias is None and blocks[i + 1].groups == 1:
            first = all(issubclass(k, (nn.Conv2d, nn.ReLU)) for k in kinds[:i]) and block.stride > 1
            parity_stride = block.stride if first else parity_stride
            steps.append(Step(i, Kind.POOL_CONV, parity_major=first))
            i += 2
        elif at(i, nn.Upsample, TGrow, nn.Conv2d) and _upsample_conv_fits(block, blocks[i + 2]):
            relu = at(i + 3, nn.ReLU)
            steps += [Step(i + 1), Step(i + 2, Kind.UPSAMPLE_CONV, relu=relu)]  # the TGrow first, at low resolution
            i += 3 + relu
        elif at(i, nn.Conv2d):
            relu = at(i + 1, nn.ReLU)
            steps.append(Step(i, Kind.CONV, relu=relu))
            i += 1 + relu
        else:
            steps.append(block_step(i, block))
            i += 1
    return make_schedule(blocks, steps, parity_stride)


def training_steps(blocks: nn.Sequential) -> list[Step]:
    """The CPU training schedule: every block as published, except that a TPool and the
    bias-free conv after it become one conv over the stacked frames (``pool_conv``: no
    full-resolution 1x1 convolution, whose backward pass is slow on CPU), and an
    Upsample(2), a TGrow and a 3x3 conv become the TGrow at low resolution, then
    ``upsample_conv`` (4x fewer pixels for the TGrow, 2.25x fewer multiply-adds for the
    conv). The function is the published one (equal in float64, within float rounding
    in float32: tests/test_dropin.py)."""
    steps, i = [], 0
    while i < len(blocks):
        if (
            i + 1 < len(blocks)
            and isinstance(blocks[i], TPool)
            and isinstance(blocks[i + 1], nn.Conv2d)
            and blocks[i + 1].bias is None
            and blocks[i + 1].groups == 1
        ):
            steps.append(Step(i, Kind.POOL_CONV))
            i += 2
        elif (
            i + 2 < len(blocks)
            and isinstance(blocks[i], nn.Upsample)
            and isinstance(blocks[i + 1], TGrow)
            and isinstance(blocks[i + 2], nn.Conv2d)
            and _upsample_conv_fits(blocks[i], blocks[i + 2])
        ):
            steps += [Step(i + 1), Step(i + 2, Kind.UPSAMPLE_CONV)]
            i += 3
        else:
            steps.append(block_step(i, blocks[i]))
            i += 1
    return steps


def _stem_fits(conv: nn.Conv2d) -> bool:
    return (
        conv.bias is None
        and conv.groups == 1
        and conv.kernel_size == (3, 3)
        and conv.stride == (2, 2)
        and conv.padding == (1, 1)
    )


def _upsample_conv_fits(up: nn.Upsample, conv: nn.Conv2d) -> bool:
    return (
        up.mode == "nearest"
        and up.scale_factor in (2, 2.0)
        and conv.kernel_size == (3, 3)
        and conv.stride == (1, 1)
        and conv.padding == (1, 1)
        and conv.groups == 1
    )
