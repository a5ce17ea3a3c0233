"""CPU fast paths of the block runner: fused oneDNN inference and the CPU training schedule.

``models.taehv.run_blocks`` asks ``choose`` once per run which path it takes and hands a
fast path the whole run (``FastPath.run``); None means the published blocks, each block's
``forward``: on GPUs, for inference under ``torch.compile``, and on CPU for inference in
other dtypes or under autocast. The fast paths compute the published function (within
float rounding) with fewer operations:

* fused inference (``fused_schedule``), on CPU for fp32 input and weights, no autocast,
  eager, no gradient wanted: each convolution is one oneDNN call with its bias, ReLU and
  residual fused (``mkldnn._convolution_pointwise``, what inductor emits on CPU),
  channels-last; the encoder's first stage runs in row bands that stay in cache
  (``stem``); a TPool and the bias-free conv after it are one conv per frame of the group
  (``pool_conv``); an Upsample(2), a TGrow and a 3x3 conv are the TGrow at low resolution,
  then four 2x2 sub-pixel convs (``upsample_conv``).
* CPU training (``training_schedule``), on CPU with gradients, eager or compiled: the same
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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn as nn
import torch.nn.functional as F

from .blocks import (
    MEMORY_BLOCKS,
    Stops,
    SuperMemBlock,
    TGrow,
    TPool,
    Work,
    find_stops,
    frames_to_channels,
    is_channels_last,
)

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
        self,
        blocks: nn.Sequential,
        x: torch.Tensor,
        memory: Sequence[torch.Tensor | None] | None,
        chunk_frames: int | None,
        split_grown_frames: bool,
        trimmed: int,
        show_progress_bar: bool,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """``models.taehv.run_blocks`` on this path's steps."""
        steps, onednn, n = self.schedule.steps, self.onednn, x.shape[0]
        stops = self.schedule.stops
        work = Work(blocks, x, memory, chunk_frames, stops, split_grown_frames, trimmed, self.layout, show_progress_bar)
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


def choose(blocks: nn.Sequential, x: torch.Tensor, onednn: OneDNN | None, keep_weights: bool) -> FastPath | None:
    """The fast path of a run of ``blocks`` on the NTCHW frames ``x``, or None (the
    published blocks). ``onednn``: the fused path's state when it outlives the run (a
    stream), else one is made that keeps derived weights for the run if ``keep_weights``."""
    if not relu_only(blocks):
        return None
    if fused_path(x, blocks):
        return FastPath(fused_schedule(blocks), onednn or OneDNN(keep_weights))
    if cpu_training(x, blocks):
        return training_path(blocks)
    return None


def relu_only(blocks: nn.Module) -> bool:
    """Whether ReLU is the only nonlinearity of ``blocks`` (all the fast paths fold)."""
    return not any(isinstance(m, nn.LeakyReLU) for m in blocks.modules())


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
# Fused convolutions: conv + bias (+ residual) (+ ReLU) is one oneDNN call with post-ops;
# with autograd the same arithmetic runs as plain ops.


def conv2d_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv: nn.Conv2d,
    onednn: OneDNN | None,
    relu: bool = False,
    add: torch.Tensor | None = None,
    padding: Sequence[int] | None = None,
) -> torch.Tensor:
    """``relu(conv2d(x, weight, bias) + add)`` with ``conv``'s stride, dilation, groups and
    (unless given) padding; the ReLU and the addition optional. On the fused path
    (``onednn``) it is one oneDNN call (weights reordered into oneDNN's layout are not
    kept across calls: a few percent of time for several MB of memory); convolutions
    over a few input channels (the encoder's first) are faster unfused."""
    padding = conv.padding if padding is None else padding
    if onednn is not None and weight.shape[1] >= 8:
        attrs = (list(padding), list(conv.stride), list(conv.dilation), conv.groups)
        if add is None:
            return torch.ops.mkldnn._convolution_pointwise(x, weight, bias, *attrs, "relu" if relu else "none", [], "")
        return torch.ops.mkldnn._convolution_pointwise.binary(
            x, add, weight, bias, *attrs, "add", 1.0, "relu" if relu else None, [], ""
        )
    y = F.conv2d(x, weight, bias, conv.stride, padding, conv.dilation, conv.groups)
    if add is not None:
        y += add  # in place: a convolution's backward does not need its output
    return F.relu(y, inplace=True) if relu else y


def conv_act(
    conv: nn.Conv2d, x: torch.Tensor, onednn: OneDNN | None, relu: bool = False, add: torch.Tensor | None = None
) -> torch.Tensor:
    """``relu(conv(x) + add)``, the ReLU and the addition optional (see ``conv2d_act``)."""
    return conv2d_act(x, conv.weight, conv.bias, conv, onednn, relu, add)


class OneDNN:
    """The fused CPU path of one run (an ``encode_video`` / ``decode_video`` call, or a
    stream). Weights derived for it (TPool-merged, sub-pixel) are made once and kept while
    the run lasts when ``keep`` (runs of many chunks share them), else made at each use;
    weights changed between runs are always seen, however they were changed."""

    def __init__(self, keep: bool):
        self.keep = keep
        self.weights: dict[tuple[int, str], object] = {}

    def weight(self, owner: nn.Module, name: str, make: Callable[[], object]) -> object:
        if not self.keep:
            return make()
        key = (id(owner), name)
        if key not in self.weights:
            self.weights[key] = make()
        return self.weights[key]


def conv_chain(
    layers: nn.Sequential, x: torch.Tensor, onednn: OneDNN | None, residual: torch.Tensor, relu_last: bool
) -> torch.Tensor:
    """A memory block's conv stack: each ReLU folds into the conv before it, the last conv
    adds the residual (and takes ``relu_last``)."""
    layers = list(layers)
    for i, layer in enumerate(layers):
        if isinstance(layer, nn.Conv2d):
            last = i == len(layers) - 1
            relu = relu_last if last else isinstance(layers[i + 1], nn.ReLU)
            x = conv_act(layer, x, onednn, relu, residual if last else None)
    return x


def forward_stacked(
    block: nn.Module, x: torch.Tensor, x_and_past: torch.Tensor, onednn: OneDNN | None = None
) -> torch.Tensor:
    """A memory block's ``forward(x, past)`` given ``cat([x, past], 1)`` (``with_past``
    builds it in one copy), its ReLUs and residual folded into its convolutions."""
    if isinstance(block, SuperMemBlock):
        return conv_chain(block.conv, x_and_past, onednn, x, relu_last=False)
    skip = conv_act(block.skip, x, onednn) if isinstance(block.skip, nn.Conv2d) else x
    return conv_chain(block.conv, x_and_past, onednn, skip, relu_last=True)  # relu_last: block.act


def with_past(x: torch.Tensor, n: int, past: torch.Tensor | None = None) -> torch.Tensor:
    """``cat([x, past], 1)`` for (N*T)CHW frames, ``past`` being each frame's predecessor
    (``past`` (NCHW) before the first, zeros if None), written in one copy in ``x``'s
    memory format."""
    nt, c, h, w = x.shape
    fmt = torch.channels_last if is_channels_last(x) else torch.contiguous_format
    out = torch.empty((nt, 2 * c, h, w), dtype=x.dtype, device=x.device, memory_format=fmt)
    seq, stacked = x.view(n, nt // n, c, h, w), out.view(n, nt // n, 2 * c, h, w)
    stacked[:, :, :c] = seq
    stacked[:, :1, c:] = 0 if past is None else past.unsqueeze(1)
    stacked[:, 1:, c:] = seq[:, :-1]
    return out


# ---------------------------------------------------------------------------------------
# Folded block groups.

PHASE_TAPS = torch.tensor([[[1.0, 0, 0], [0, 1, 1]], [[1, 1, 0], [0, 0, 1]]])  # [phase, 2 taps, 3 taps]


def upsample_conv(conv: nn.Conv2d, x: torch.Tensor, onednn: OneDNN | None, relu: bool) -> torch.Tensor:
    """``conv(nearest_upsample_2x(x))`` (then ReLU) computed at ``x``'s resolution: output
    row 2i + a sees input rows (i-1, i, i) for a = 0 and (i, i, i+1) for a = 1, so each of
    the four output phases is a 2x2 convolution with summed taps (16 taps per 4 output
    pixels instead of 36: 2.25x fewer FLOPs), written into its place of a channels-last
    output."""
    nt, _, h, w = x.shape
    taps = PHASE_TAPS.to(conv.weight)

    def make_phases() -> torch.Tensor:
        return torch.einsum("aik,bjl,oqkl->aboqij", taps, taps, conv.weight)

    padded = F.pad(x, (1, 1, 1, 1))
    if onednn is None:  # autograd: the phase weights derive from conv.weight inside the graph
        phases = make_phases()
        ys = [
            conv2d_act(
                padded[:, :, a : a + h + 1, b : b + w + 1], phases[a][b], conv.bias, conv, None, relu, padding=(0, 0)
            )
            for a in range(2)
            for b in range(2)
        ]
        return torch.stack(ys, 2).unflatten(2, (2, 2)).permute(0, 1, 4, 2, 5, 3).reshape(nt, -1, 2 * h, 2 * w)
    phases = onednn.weight(conv, "phases", make_phases)
    out = x.new_empty(nt, h, 2, w, 2, conv.out_channels)
    for a in range(2):
        for b in range(2):
            y = conv2d_act(
                padded[:, :, a : a + h + 1, b : b + w + 1], phases[a][b], conv.bias, conv, onednn, relu, padding=(0, 0)
            )
            out[:, :, a, :, b].copy_(y.permute(0, 2, 3, 1))
    return out.view(nt, 2 * h, 2 * w, -1).permute(0, 3, 1, 2)


def pool_conv(
    pool: TPool,
    conv: nn.Conv2d,
    x: torch.Tensor,
    onednn: OneDNN | None,
    parity_major: bool,
    padding: Sequence[int] | None = None,
) -> torch.Tensor:
    """``conv(pool(x))`` for a TPool followed by a bias-free conv, without stacking frames
    on channels: both are linear, so it is a sum over each group's ``stride`` frames of
    one conv each, with weight ``conv.weight`` times the frame's slice of ``pool``'s.
    Frame k of every group is ``x``'s k-th block when ``parity_major``, else a strided view."""
    stride, (nt, c, h, w) = pool.stride, x.shape

    def make_weight() -> torch.Tensor:
        return torch.einsum("omyx,mj->ojyx", conv.weight, pool.conv.weight[:, :, 0, 0])

    if onednn is None:  # autograd: one conv over the stacked frames, its weight derived inside the graph
        padding = conv.padding if padding is None else padding
        return F.conv2d(frames_to_channels(x, stride), make_weight(), conv.bias, conv.stride, padding, conv.dilation)
    weights = onednn.weight(conv, "pooled", lambda: make_weight().split(c, 1))
    frames = (
        x.view(stride, nt // stride, c, h, w).unbind(0)
        if parity_major
        else x.view(nt // stride, stride, c, h, w).unbind(1)
    )
    y = None
    for frame, weight in zip(frames, weights):
        y = conv2d_act(frame, weight, conv.bias if y is None else None, conv, onednn, add=y, padding=padding)
    return y


BAND_BYTES = 4 << 20  # the encoder stem's full-resolution activations per band: cache-sized


def stem(conv_in: nn.Conv2d, pool: TPool, conv: nn.Conv2d, x: torch.Tensor, onednn: OneDNN) -> torch.Tensor:
    """The encoder's first stage, ``conv(pool(relu(conv_in(x))))`` on a parity-major
    input, in bands of rows: its full-resolution activations (64 channels) then never
    exist whole, so they stay in cache instead of being written to fresh memory and read
    back. Output rows [r0, r1) of the stride-2 conv read rows [2r0 - 1, 2r1) of
    ``relu(conv_in(x))`` (row -1 is its zero padding), which read input rows
    [2r0 - 2, 2r1 + 1) (zeros outside)."""
    nt, _, h, w = x.shape
    out_h = h // 2
    out = x.new_empty((nt // pool.stride, conv.out_channels, out_h, w // 2)).contiguous(
        memory_format=torch.channels_last
    )
    band = max(1, BAND_BYTES // (nt * conv_in.out_channels * 2 * w * x.element_size()))
    for r0 in range(0, out_h, band):
        r1 = min(r0 + band, out_h)
        lo, hi = max(2 * r0 - 1, 0), 2 * r1  # rows of relu(conv_in(x)) computed here
        rows = F.pad(x[:, :, max(lo - 1, 0) : min(hi + 1, h)], (0, 0, int(lo == 0), int(hi + 1 > h)))
        features = conv2d_act(rows, conv_in.weight, conv_in.bias, conv_in, onednn, relu=True, padding=(0, 1))
        if r0 == 0:
            features = F.pad(features, (0, 0, 1, 0))
        out[:, :, r0:r1] = pool_conv(pool, conv, features, onednn, parity_major=True, padding=(0, 1))
    return out


def parity_major(x: torch.Tensor, stride: int) -> torch.Tensor:
    """NTCHW frames as (N*T)CHW channels-last with frame k of every group of ``stride``
    in the k-th block (what ``pool_conv`` reads without strides), in the one copy that
    the channels-last conversion makes anyway."""
    n, t, c, h, w = x.shape
    out = torch.empty((n * t, c, h, w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    out.view(stride, n, t // stride, c, h, w).copy_(x.view(n, t // stride, stride, c, h, w).permute(2, 0, 1, 3, 4, 5))
    return out


# ---------------------------------------------------------------------------------------
# Schedules, made once per block sequence.


def fused_schedule(blocks: nn.Sequential) -> Schedule:
    """The fused path's schedule for ``blocks`` (made once): the steps, and the stride for
    a parity-major input layout (0: none). Convolutions take the ReLU that follows; a TPool and
    the bias-free conv after it become ``pool_conv`` (the first one, if only convs and
    ReLUs precede it, reads a parity-major input without strides); an Upsample(2), a TGrow
    and a 3x3 conv become the TGrow at low resolution (1x1 convs commute with nearest
    upsampling), then ``upsample_conv``."""
    cached = blocks.__dict__.get("_fused_schedule")
    if cached is not None:
        return cached
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
    blocks.__dict__["_fused_schedule"] = make_schedule(blocks, steps, parity_stride)
    return blocks.__dict__["_fused_schedule"]


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


def training_path(blocks: nn.Sequential) -> FastPath:
    """The CPU training path of ``blocks`` (made once)."""
    cached = blocks.__dict__.get("_training_path")
    if cached is None:
        cached = blocks.__dict__["_training_path"] = FastPath(make_schedule(blocks, training_steps(blocks)))
    return cached


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
