"""TAEHV: Tiny AutoEncoder for Hunyuan Video (and TAECVX, TAEW2.x, TAEHV1.5, TAEH3, TAELTX2.x).

State-dict keys, shapes and outputs match the published ``taehv.py``, so the published
weight files load here and weights trained here load there. Layout per model:

    encoder: conv, ReLU, 3 x [TPool, conv/2, MemBlock x3], conv -> latent
    decoder: Clamp, conv, ReLU, 3 x [MemBlock x3, Upsample, TGrow, conv], ReLU, conv
    wide decoder: the same with widths 1024/512/256/64 and WideMemBlocks
    super decoder: conv1x1, 3 x [SuperMemBlock x3, conv, PixelShuffle, ReLU, TGrow], conv

TAELTX pools and grows time in all three stages (8x); TAEH3 encodes 17-frame chunks
on their own (``encode_h3_chunks``). Videos are NTCHW tensors in [0, 1]; latents are the
raw (unscaled) latents of the reference VAE. Frame counts follow ``VariantSpec.plan``.

One block runner (``run_chunk``) serves every call: all frames of a chunk pass each block
together, memory blocks carry their last input to the next chunk. On CPU inference it
follows a fused schedule (``fused_steps``: oneDNN convolutions with bias, ReLU and
residual fused, channels-last, TPools folded into the next conv, sub-pixel upsampling
convs); CPU training follows ``autograd_steps`` (the same folds as plain differentiable
ops); GPU runs, and CPU inference in other dtypes, run the blocks as published.
The published ``taehv.py``'s constructor, methods and ``StreamingTAEHV`` work unchanged.
"""
from __future__ import annotations

import logging
import math
import os
from collections import deque
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from .weights import load_weights, read_metadata
from .frames import H3_CHUNK_FRAMES, H3_DROPPED_LATENTS, H3_LEFT_PAD, FramePlan, h3_kept_frames, plan_frames
from .variants import resolve_variant, time_strides, time_switches

logger = logging.getLogger(__name__)


def conv(n_in: int, n_out: int, **kwargs) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, **kwargs)


# ---------------------------------------------------------------------------------------
# Fused convolutions. On CPU inference, conv + bias (+ residual) (+ ReLU) is one oneDNN
# call with post-ops (what inductor emits on CPU); with autograd, on GPUs and under
# torch.compile the same arithmetic runs as plain ops (there cuDNN or inductor fuse).

_ONEDNN_POINTWISE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_convolution_pointwise")


def fused_path(x: torch.Tensor, blocks: nn.Module) -> bool:
    """Whether a run of ``blocks`` on ``x`` takes the fused oneDNN path: CPU, fp32 input
    and weights, no autocast, eager, and no gradient wanted (grad mode off, or neither
    input nor weights require it)."""
    if not (_ONEDNN_POINTWISE and x.device.type == "cpu" and x.dtype == torch.float32) or torch.compiler.is_compiling():
        return False
    if torch.is_autocast_enabled("cpu") or any(p.dtype != torch.float32 for p in blocks.parameters()):
        return False
    return not wants_grad(x, blocks)


def wants_grad(x: torch.Tensor, blocks: nn.Module) -> bool:
    """Whether a run of ``blocks`` on ``x`` records gradients."""
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in blocks.parameters()))


def conv2d_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv: nn.Conv2d,
               onednn: OneDNN | None, relu: bool = False, add: torch.Tensor | None = None,
               padding: Sequence[int] | None = None) -> torch.Tensor:
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
        return torch.ops.mkldnn._convolution_pointwise.binary(x, add, weight, bias, *attrs, "add", 1.0,
                                                              "relu" if relu else None, [], "")
    y = F.conv2d(x, weight, bias, conv.stride, padding, conv.dilation, conv.groups)
    if add is not None:
        y += add  # in place: a convolution's backward does not need its output
    return F.relu(y, inplace=True) if relu else y


def conv_act(conv: nn.Conv2d, x: torch.Tensor, onednn: OneDNN | None, relu: bool = False,
             add: torch.Tensor | None = None) -> torch.Tensor:
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


def conv_chain(layers: nn.Sequential, x: torch.Tensor, onednn: OneDNN | None, residual: torch.Tensor, relu_last: bool) -> torch.Tensor:
    """A memory block's conv stack: each ReLU folds into the conv before it, the last conv
    adds the residual (and takes ``relu_last``)."""
    layers = list(layers)
    for i, layer in enumerate(layers):
        if isinstance(layer, nn.Conv2d):
            last = i == len(layers) - 1
            relu = relu_last if last else isinstance(layers[i + 1], nn.ReLU)
            x = conv_act(layer, x, onednn, relu, residual if last else None)
    return x


class Clamp(nn.Module):
    """Soft clamp of decoder inputs to about [-3, 3]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class MemBlock(nn.Module):
    """Residual conv block that also sees its own input from the previous timestep."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.conv = nn.Sequential(
            conv(n_in * 2, n_out), nn.ReLU(inplace=True), conv(n_out, n_out), nn.ReLU(inplace=True), conv(n_out, n_out)
        )
        self.skip = nn.Conv2d(n_in, n_out, 1, bias=False) if n_in != n_out else nn.Identity()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return self.forward_stacked(x, torch.cat([x, past], 1))

    def forward_stacked(self, x: torch.Tensor, x_and_past: torch.Tensor, onednn: OneDNN | None = None) -> torch.Tensor:
        """``forward`` given ``cat([x, past], 1)``, which the runner builds in one copy."""
        skip = conv_act(self.skip, x, onednn) if isinstance(self.skip, nn.Conv2d) else x
        return conv_chain(self.conv, x_and_past, onednn, skip, relu_last=True)


class SuperMemBlock(nn.Module):
    """ConvNeXt-style memory block of the "super" decoder: 7x7 depthwise, expand, project."""

    def __init__(self, n_f: int, expansion: int = 2):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(n_f * 2, n_f * 2, 7, padding=3, groups=n_f * 2, bias=False),
            nn.Conv2d(n_f * 2, n_f * 2 * expansion, 1),
            nn.ReLU(inplace=True),
            nn.Conv2d(n_f * 2 * expansion, n_f, 1, bias=False),
        )

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return self.forward_stacked(x, torch.cat([x, past], 1))

    def forward_stacked(self, x: torch.Tensor, x_and_past: torch.Tensor, onednn: OneDNN | None = None) -> torch.Tensor:
        return conv_chain(self.conv, x_and_past, onednn, x, relu_last=False)


class WideMemBlock(nn.Module):
    """Memory block of the wide decoder: 1x1 mix of frame and past, grouped 3x3 (64
    channels per group), 1x1, grouped 3x3; a 1x1 skip when the widths differ."""

    def __init__(self, n_in: int, n_out: int, group_width: int = 64):
        super().__init__()
        groups = n_out // group_width
        self.conv = nn.Sequential(
            nn.Conv2d(n_in * 2, n_out, 1), nn.ReLU(inplace=True), conv(n_out, n_out, groups=groups),
            nn.ReLU(inplace=True), nn.Conv2d(n_out, n_out, 1), nn.ReLU(inplace=True), conv(n_out, n_out, groups=groups),
        )
        self.skip = nn.Conv2d(n_in, n_out, 1, bias=False) if n_in != n_out else nn.Identity()
        self.act = nn.ReLU(inplace=True)

    forward = MemBlock.forward
    forward_stacked = MemBlock.forward_stacked


MEMORY_BLOCKS = (MemBlock, SuperMemBlock, WideMemBlock)


def frames_to_channels(x: torch.Tensor, stride: int) -> torch.Tensor:
    """(N*T, C, H, W) -> (N*T/stride, stride*C, H, W), consecutive frames side by side on
    channels, in ``x``'s memory format (a view for contiguous tensors, one copy for
    channels-last ones)."""
    nt, c, h, w = x.shape
    if stride == 1 or not _channels_last(x):
        return x.reshape(nt // stride, stride * c, h, w)
    out = torch.empty((nt // stride, stride * c, h, w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    out.view(nt // stride, stride, c, h, w).copy_(x.view(nt // stride, stride, c, h, w))
    return out


def channels_to_frames(x: torch.Tensor, stride: int) -> torch.Tensor:
    """The inverse of ``frames_to_channels``."""
    n, sc, h, w = x.shape
    if stride == 1 or not _channels_last(x):
        return x.reshape(n * stride, sc // stride, h, w)
    out = torch.empty((n * stride, sc // stride, h, w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    out.view(n, stride, sc // stride, h, w).copy_(x.view(n, stride, sc // stride, h, w))
    return out


def _channels_last(x: torch.Tensor) -> bool:
    return not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


class TPool(nn.Module):
    """Temporal pooling: ``stride`` consecutive frames stacked on channels, then 1x1 conv."""

    def __init__(self, n_f: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(n_f * stride, n_f, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(frames_to_channels(x, self.stride))


class TGrow(nn.Module):
    """Temporal upsampling: 1x1 conv to ``stride`` times the channels, split into frames."""

    def __init__(self, n_f: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(n_f, n_f * stride, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return channels_to_frames(self.conv(x), self.stride)


def build_encoder(in_channels: int, latent_channels: int, time_strides: Sequence[int]) -> nn.Sequential:
    stages = []
    for stride in time_strides:
        stages += [TPool(64, stride), conv(64, 64, stride=2, bias=False)]
        stages += [MemBlock(64, 64) for _ in range(3)]
    return nn.Sequential(conv(in_channels, 64), nn.ReLU(inplace=True), *stages, conv(64, latent_channels))


def build_decoder(latent_channels: int, out_channels: int, time_strides: Sequence[int], space_upscale: Sequence[bool],
                  wide: bool = False) -> nn.Sequential:
    n_f, block = ([1024, 512, 256, 64], WideMemBlock) if wide else ([256, 128, 64, 64], MemBlock)
    stages = []
    for i, (t_up, s_up) in enumerate(zip(time_strides, space_upscale)):
        stages += [block(n_f[i], n_f[i]) for _ in range(3)]
        stages += [nn.Upsample(scale_factor=2 if s_up else 1), TGrow(n_f[i], t_up), conv(n_f[i], n_f[i + 1], bias=False)]
    return nn.Sequential(
        Clamp(), conv(latent_channels, n_f[0]), nn.ReLU(inplace=True), *stages, nn.ReLU(inplace=True), conv(n_f[3], out_channels)
    )


def build_super_decoder(latent_channels: int, out_channels: int, time_strides: Sequence[int], space_upscale: Sequence[bool]) -> nn.Sequential:
    n_f = [512, 256, 128, 64]
    stages = []
    for i, (t_up, s_up) in enumerate(zip(time_strides, space_upscale)):
        r = 2 if s_up else 1
        stages += [SuperMemBlock(n_f[i]) for _ in range(3)]
        stages += [nn.Conv2d(n_f[i], n_f[i + 1] * r * r, 3, padding=1), nn.PixelShuffle(r), nn.ReLU(inplace=True)]
        stages += [TGrow(n_f[i + 1], t_up)]
    return nn.Sequential(nn.Conv2d(latent_channels, n_f[0], 1, bias=False), *stages, conv(n_f[3], out_channels))


# ---------------------------------------------------------------------------------------
# Running a block sequence over time. The clip goes through in chunks of frames: all of a
# chunk's frames pass each block together (time-parallel), and each memory block carries
# its last input into the next chunk, so every chunking gives the same frames. One chunk
# of the whole clip is parallel mode (O(T) memory); chunks of ``t_downscale`` frames
# (encoder) or one latent (decoder) are sequential mode and streaming (memory flat in T).


def with_past(x: torch.Tensor, n: int, past: torch.Tensor | None = None) -> torch.Tensor:
    """``cat([x, past], 1)`` for (N*T)CHW frames, ``past`` being each frame's predecessor
    (``past`` (NCHW) before the first, zeros if None), written in one copy in ``x``'s
    memory format."""
    nt, c, h, w = x.shape
    fmt = torch.channels_last if _channels_last(x) else torch.contiguous_format
    out = torch.empty((nt, 2 * c, h, w), dtype=x.dtype, device=x.device, memory_format=fmt)
    seq, stacked = x.view(n, nt // n, c, h, w), out.view(n, nt // n, 2 * c, h, w)
    stacked[:, :, :c] = seq
    stacked[:, :1, c:] = 0 if past is None else past.unsqueeze(1)
    stacked[:, 1:, c:] = seq[:, :-1]
    return out


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
        ys = [conv2d_act(padded[:, :, a:a + h + 1, b:b + w + 1], phases[a][b], conv.bias, conv, None, relu, padding=(0, 0))
              for a in range(2) for b in range(2)]
        return torch.stack(ys, 2).unflatten(2, (2, 2)).permute(0, 1, 4, 2, 5, 3).reshape(nt, -1, 2 * h, 2 * w)
    phases = onednn.weight(conv, "phases", make_phases)
    out = x.new_empty(nt, h, 2, w, 2, conv.out_channels)
    for a in range(2):
        for b in range(2):
            y = conv2d_act(padded[:, :, a:a + h + 1, b:b + w + 1], phases[a][b], conv.bias, conv, onednn, relu,
                           padding=(0, 0))
            out[:, :, a, :, b].copy_(y.permute(0, 2, 3, 1))
    return out.view(nt, 2 * h, 2 * w, -1).permute(0, 3, 1, 2)


def pool_conv(pool: TPool, conv: nn.Conv2d, x: torch.Tensor, onednn: OneDNN | None, parity_major: bool,
              padding: Sequence[int] | None = None) -> torch.Tensor:
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
    frames = x.view(stride, nt // stride, c, h, w).unbind(0) if parity_major else x.view(nt // stride, stride, c, h, w).unbind(1)
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
    out = x.new_empty((nt // pool.stride, conv.out_channels, out_h, w // 2)).contiguous(memory_format=torch.channels_last)
    band = max(1, BAND_BYTES // (nt * conv_in.out_channels * 2 * w * x.element_size()))
    for r0 in range(0, out_h, band):
        r1 = min(r0 + band, out_h)
        lo, hi = max(2 * r0 - 1, 0), 2 * r1  # rows of relu(conv_in(x)) computed here
        rows = F.pad(x[:, :, max(lo - 1, 0):min(hi + 1, h)], (0, 0, int(lo == 0), int(hi + 1 > h)))
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


def run_chunk(blocks: nn.Sequential, x: torch.Tensor, memory: list[torch.Tensor | None],
              onednn: OneDNN | None = None, frame_by_frame: bool = False, drop: int = 0
              ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """One NTCHW chunk through ``blocks`` (TPool strides must divide T): the NTCHW frames
    it yields, and ``memory`` updated (per block, the memory block's input frame before
    the chunk; None: zeros). No side effects, so ``torch.compile`` takes it whole.
    ``onednn``: the fused path's state for a run of several chunks. ``frame_by_frame``:
    the frames a TGrow makes go on one at a time (sequential mode: one frame, not
    ``t_upscale``, at full resolution). ``drop``: leading output frames nobody wants
    (the decoder's trimmed frames); the blocks after the last temporal one skip them,
    and None comes back when every frame is dropped."""
    n = x.shape[0]
    onednn = (onednn or OneDNN(keep=False)) if fused_path(x, blocks) else None
    memory = list(memory)
    if onednn:
        parity_stride, steps = fused_steps(blocks)
    else:
        parity_stride, steps = 0, autograd_steps(blocks) if cpu_training(x, blocks) else plain_steps(blocks)
    if parity_stride:
        x = parity_major(x, parity_stride)
    else:
        x = x.flatten(0, 1)
        if onednn:
            x = x.contiguous(memory_format=torch.channels_last)
    y = run_steps(blocks, steps, x, n, memory, onednn, frame_by_frame, drop)
    return (None if y is None else y.unflatten(0, (n, -1))), memory


def run_steps(blocks: nn.Sequential, steps: list[tuple[int, str, object]], x: torch.Tensor, n: int,
              memory: list[torch.Tensor | None], onednn: OneDNN | None, frame_by_frame: bool,
              drop: int = 0) -> torch.Tensor | None:
    """``steps`` on (N*T)CHW frames, updating ``memory`` in place (see ``run_chunk``)."""
    tail = per_frame_tail(blocks, steps)
    for k, (i, kind, arg) in enumerate(steps):
        if k == tail and drop:
            x = drop_frames(x, n, drop)
            if x is None:
                return None
        block = blocks[i]
        if kind == "memory":
            stacked = with_past(x, n, memory[i])
            memory[i] = x.unflatten(0, (n, -1))[:, -1].clone()
            x = block.forward_stacked(x, stacked, onednn)
        elif kind == "block":
            x = block(x)
        elif kind == "conv":  # arg: the ReLU that follows, folded in
            x = conv_act(block, x, onednn, relu=arg)
        elif kind == "conv_shuffle_relu":  # the ReLU after the PixelShuffle commutes with it
            x = F.pixel_shuffle(conv_act(block, x, onednn, relu=True), blocks[i + 1].upscale_factor)
        elif kind == "upsample_conv":  # the Upsample before the TGrow (run before it, at low resolution)
            x = upsample_conv(block, x, onednn, relu=arg)
        elif kind == "pool_conv":  # arg: frames laid out parity-major
            x = pool_conv(block, blocks[i + 1], x, onednn, parity_major=arg)
        elif kind == "stem":
            x = stem(block, blocks[i + 2], blocks[i + 3], x, onednn)
        if frame_by_frame and isinstance(block, TGrow) and block.stride > 1 and x.shape[0] > n:
            rest = steps[k + 1:]
            each = stride_product(blocks, TGrow, i + 1)  # output frames per frame from here
            outs = [run_steps(blocks, rest, frame, n, memory, onednn, frame_by_frame, min(max(drop - j * each, 0), each))
                    for j, frame in enumerate(x.unflatten(0, (n, -1)).unbind(1))]
            outs = [o.unflatten(0, (n, -1)) for o in outs if o is not None]
            return torch.cat(outs, 1).flatten(0, 1) if outs else None
    return drop_frames(x, n, drop) if tail == len(steps) and drop else x


def drop_frames(x: torch.Tensor, n: int, drop: int) -> torch.Tensor | None:
    """(N*T)CHW frames without the first ``drop`` of each sequence; None if none is left."""
    frames = x.shape[0] // n
    return None if drop >= frames else x.unflatten(0, (n, frames))[:, drop:].flatten(0, 1)


def temporal(block: nn.Module, kind: str) -> bool:
    """Whether a step mixes or changes frames (anything else runs frame by frame)."""
    return kind in ("memory", "pool_conv", "stem") or (isinstance(block, (TGrow, TPool)) and block.stride > 1)


def per_frame_tail(blocks: nn.Sequential, steps: list[tuple[int, str, object]]) -> int:
    """The index of the first of the steps after the last temporal one."""
    tail = 0
    for k, (i, kind, _) in enumerate(steps):
        if temporal(blocks[i], kind):
            tail = k + 1
    return tail


def stride_product(blocks: nn.Sequential, kind: type, first: int = 0) -> int:
    """The product of the strides of the ``kind`` blocks (TPool or TGrow) in ``blocks[first:]``
    (a plain loop: ``torch.compile`` traces it)."""
    product = 1
    for block in list(blocks)[first:]:
        if isinstance(block, kind):
            product *= block.stride
    return product


def time_scale(blocks: nn.Sequential, first: int = 0) -> Fraction:
    """Output frames per input frame of ``blocks[first:]``, exact (strides of 3 too)."""
    return Fraction(stride_product(blocks, TGrow, first), stride_product(blocks, TPool, first))


def fused_steps(blocks: nn.Sequential) -> tuple[int, list[tuple[int, str, object]]]:
    """The fused path's schedule for ``blocks``, made once per block sequence: the stride
    for a parity-major input layout (0: none), and (first block, kind, argument) per step.
    Convolutions take the ReLU that follows; a TPool and the bias-free conv after it
    become ``pool_conv`` (the first one, if only convs and ReLUs precede it, reads a
    parity-major input without strides); an Upsample(2), a
    TGrow and a 3x3 conv become the TGrow at low resolution (1x1 convs commute with
    nearest upsampling), then ``upsample_conv``; a conv, PixelShuffle and ReLU take the ReLU too."""
    cached = blocks.__dict__.get("_fused_steps")
    if cached is not None:
        return cached
    parity_stride, steps = 0, []
    kinds = [type(b) for b in blocks]

    def at(j: int, *types: type) -> bool:
        return all(j + k < len(blocks) and issubclass(kinds[j + k], t) for k, t in enumerate(types))

    i = 0
    if at(0, nn.Conv2d, nn.ReLU, TPool, nn.Conv2d) and _stem_fits(blocks[2], blocks[3]):
        parity_stride = blocks[2].stride
        steps.append((0, "stem", None))
        i = 4
    while i < len(blocks):
        block = blocks[i]
        if at(i, TPool, nn.Conv2d) and blocks[i + 1].bias is None and blocks[i + 1].groups == 1:
            first = all(issubclass(k, (nn.Conv2d, nn.ReLU)) for k in kinds[:i]) and block.stride > 1
            parity_stride = block.stride if first else parity_stride
            steps.append((i, "pool_conv", first))
            i += 2
        elif at(i, nn.Upsample, TGrow, nn.Conv2d) and _upsample_conv_fits(block, blocks[i + 2]):
            relu = at(i + 3, nn.ReLU)
            steps += [(i + 1, "block", None), (i + 2, "upsample_conv", relu)]  # the TGrow first, at low resolution
            i += 3 + relu
        elif at(i, nn.Conv2d, nn.PixelShuffle, nn.ReLU):
            steps.append((i, "conv_shuffle_relu", None))
            i += 3
        elif at(i, nn.Conv2d):
            relu = at(i + 1, nn.ReLU)
            steps.append((i, "conv", relu))
            i += 1 + relu
        else:
            steps += plain_steps(blocks[i:i + 1], i)
            i += 1
    blocks.__dict__["_fused_steps"] = parity_stride, steps
    return parity_stride, steps


def cpu_training(x: torch.Tensor, blocks: nn.Module) -> bool:
    """Whether a run takes ``autograd_steps``: with gradients on a CPU (on GPUs the
    published blocks are faster). A shape-only run on the ``meta`` device (the pre-flight's
    memory estimate) takes the schedule this machine would train with."""
    device = x.device.type
    if device == "meta":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device == "cpu" and wants_grad(x, blocks)


def autograd_steps(blocks: nn.Sequential) -> list[tuple[int, str, object]]:
    """The CPU training schedule: every block as published, except that a TPool and the
    bias-free conv after it become one conv over the stacked frames (``pool_conv``: no
    full-resolution 1x1 convolution, whose backward pass is slow on CPU), and an
    Upsample(2), a TGrow and a 3x3 conv become the TGrow at low resolution, then
    ``upsample_conv`` (4x fewer pixels for the TGrow, 2.25x fewer multiply-adds for the
    conv). Derived weights are computed inside autograd, so the gradients reach the
    published parameters; the function is the published one (equal in float64, within
    float rounding in float32: tests/test_dropin.py)."""
    cached = blocks.__dict__.get("_autograd_steps")
    if cached is not None:
        return cached
    steps, i = [], 0
    while i < len(blocks):
        if (i + 1 < len(blocks) and isinstance(blocks[i], TPool) and isinstance(blocks[i + 1], nn.Conv2d)
                and blocks[i + 1].bias is None and blocks[i + 1].groups == 1):
            steps.append((i, "pool_conv", False))
            i += 2
        elif (i + 2 < len(blocks) and isinstance(blocks[i], nn.Upsample) and isinstance(blocks[i + 1], TGrow)
                and isinstance(blocks[i + 2], nn.Conv2d) and _upsample_conv_fits(blocks[i], blocks[i + 2])):
            steps += [(i + 1, "block", None), (i + 2, "upsample_conv", False)]
            i += 3
        else:
            steps += plain_steps(blocks[i:i + 1], i)
            i += 1
    blocks.__dict__["_autograd_steps"] = steps
    return steps


def plain_steps(blocks: nn.Sequential, first: int = 0) -> list[tuple[int, str, object]]:
    """Every block on its own (the published computation): GPUs, compile, and CPU runs that
    neither the fused nor the autograd schedule takes."""
    return [(first + i, "memory" if isinstance(b, MEMORY_BLOCKS) else "block", None) for i, b in enumerate(blocks)]


def _stem_fits(pool: TPool, conv: nn.Conv2d) -> bool:
    return (conv.bias is None and conv.groups == 1 and conv.kernel_size == (3, 3) and conv.stride == (2, 2)
            and conv.padding == (1, 1))


def _upsample_conv_fits(up: nn.Upsample, conv: nn.Conv2d) -> bool:
    return (up.mode == "nearest" and up.scale_factor in (2, 2.0) and conv.kernel_size == (3, 3)
            and conv.stride == (1, 1) and conv.padding == (1, 1) and conv.groups == 1)


class BlockRunner:
    """Runs ``blocks`` over successive chunks of a clip, carrying the memory between them;
    the first ``drop`` output frames of the clip are skipped (see ``run_chunk``)."""

    def __init__(self, blocks: nn.Sequential, run: Callable = run_chunk, keep_weights: bool = True,
                 frame_by_frame: bool = True, drop: int = 0):
        self.blocks, self.run, self.frame_by_frame, self.drop = blocks, run, frame_by_frame, drop
        self.memory: list[torch.Tensor | None] = [None] * len(blocks)
        self.onednn = OneDNN(keep_weights)
        self.scale = time_scale(blocks)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The chunk's NTCHW output frames (None while all of them are dropped)."""
        drop = min(self.drop, int(x.shape[1] * self.scale))
        if self.run is run_chunk:
            y, memory = run_chunk(self.blocks, x, self.memory, self.onednn, self.frame_by_frame, drop)
        else:  # compiled; CUDA graphs reuse their output buffers on the next call
            y, memory = self.run(self.blocks, x, self.memory, None, self.frame_by_frame, drop)
            y, memory = None if y is None else y.clone(), [None if m is None else m.clone() for m in memory]
        self.memory, self.drop = memory, self.drop - drop
        return y


SEQUENTIAL_CHUNK_BYTES = 1 << 20  # sequential decoding's first-stage activations per chunk (see latents_per_chunk)


def run_blocks(blocks: nn.Sequential, x: torch.Tensor, parallel: bool, chunk: int, show_progress_bar: bool = False,
               run: Callable = run_chunk, drop: int = 0) -> torch.Tensor:
    """Apply ``blocks`` to an NTCHW tensor: all frames at once (``parallel``) or ``chunk``
    frames at a time (memory flat in T), without the first ``drop`` output frames (which
    the blocks after the last temporal one skip). Chunks are written into one output."""
    if x.ndim != 5:
        raise ValueError(f"TAEHV works on NTCHW tensors, got shape {tuple(x.shape)}")
    chunks = [x] if parallel else x.tensor_split(-(-x.shape[1] // chunk), dim=1)  # even sizes
    runner = BlockRunner(blocks, run, keep_weights=len(chunks) > 1 or not parallel,  # blocks run more than once
                         frame_by_frame=not parallel, drop=drop)
    if len(chunks) == 1:
        return runner(x)
    out, t = None, 0
    for c in tqdm(chunks, desc="chunks", disable=not show_progress_bar):
        y = runner(c)
        if y is None:
            continue
        if out is None:
            out = y.new_empty((x.shape[0], int(x.shape[1] * runner.scale) - drop, *y.shape[2:]))
        out[:, t:t + y.shape[1]] = y
        t += y.shape[1]
    return out


# ---------------------------------------------------------------------------------------


class AutoencoderOutput(NamedTuple):
    """What ``TAEHV.forward`` returns for training (decoded frames unclamped)."""

    latents: torch.Tensor
    decoded: torch.Tensor | None
    decoded_from_reference: torch.Tensor | None


PUBLISHED_DEFAULT_CHECKPOINT = "taehv.pth"
COMPILE_CACHE_LIMIT = 64  # compiled graphs of run_chunk kept (dynamo's default, 8, is hit by training + validation)
_UNSET = object()


class TAEHV(nn.Module):
    def __init__(
        self,
        checkpoint_path: str | os.PathLike | None = _UNSET,  # type: ignore[assignment]
        encoder_time_downscale: Sequence[bool] | None = None,
        decoder_time_upscale: Sequence[bool] | None = None,
        decoder_space_upscale: Sequence[bool] = (True, True, True),
        patch_size: int = 1,
        latent_channels: int = 16,
        arch_variant: str | None = None,
        variant: str | None = None,
        arch_name: str | None = None,
    ):
        """Build a TAEHV and optionally load published or trained weights.

        A drop-in for the published ``taehv.py``: its arguments, in its order, with its
        defaults, plus ``variant`` (``arch_name``, upstream's newer keyword, is the same).

        Args:
            checkpoint_path: ``.pth`` or ``.safetensors`` weights; None builds a fresh model.
                Left out, it is ``"taehv.pth"`` as in the published file, unless ``variant``
                or ``arch_name`` names the architecture (then a fresh model).
            encoder_time_downscale / decoder_time_upscale / decoder_space_upscale: per-stage
                switches (None: the variant's); a 2-tuple ``decoder_time_upscale`` gets
                ``False`` prepended. Fewer upscales give a cheaper preview decoder that
                still loads full weights.
            patch_size, latent_channels, arch_variant (None or "base", "super", "wide"):
                architecture, used when neither ``variant`` nor the checkpoint says otherwise
                ("super" with a base variant's file name picks that variant's super decoder).
            variant / arch_name: explicit variant name ("taehv", "taecvx", "taehv1_5",
                "taew2_2", "taehv1_5_super", "taeh3", "taeltx2_3", "taeltx2_3_wide", ...).
                Without it the variant comes from the safetensors metadata or the file name,
                as users name the published files.
        """
        super().__init__()
        if arch_name is not None and variant is not None and arch_name != variant:
            raise ValueError(f"arch_name={arch_name!r} and variant={variant!r} disagree: give one of them")
        variant = variant or arch_name
        if checkpoint_path is _UNSET:
            checkpoint_path = None if variant is not None else PUBLISHED_DEFAULT_CHECKPOINT
        metadata = read_metadata(checkpoint_path) if checkpoint_path is not None else None
        spec = resolve_variant(variant, checkpoint_path, patch_size, latent_channels, arch_variant, metadata)
        encoder_time_downscale = spec.encoder_time_downscale if encoder_time_downscale is None else encoder_time_downscale
        decoder_time_upscale = spec.decoder_time_upscale if decoder_time_upscale is None else decoder_time_upscale
        if len(decoder_time_upscale) == 2:
            decoder_time_upscale = (False, *decoder_time_upscale)
        self.spec = spec
        self.variant = spec.name
        self.patch_size = spec.patch_size
        self.latent_channels = spec.latent_channels
        self.arch_variant = spec.arch
        self.is_cogvideox = spec.is_cogvideox
        self.h3_chunks = self.is_h3 = spec.h3_chunks
        self.image_channels = spec.image_channels
        self.causal = spec.causal
        encoder_strides, decoder_strides = time_strides(encoder_time_downscale), time_strides(decoder_time_upscale)
        self.encoder_time_downscale = time_switches(encoder_strides)  # booleans as published; strides where a 3 is
        self.decoder_time_upscale = time_switches(decoder_strides)
        self.decoder_space_upscale = tuple(bool(v) for v in decoder_space_upscale)

        pixels = self.image_channels * self.patch_size**2
        self.encoder = build_encoder(pixels, self.latent_channels, encoder_strides)
        if spec.arch == "super":
            self.decoder = build_super_decoder(self.latent_channels, pixels, decoder_strides, self.decoder_space_upscale)
        else:
            self.decoder = build_decoder(self.latent_channels, pixels, decoder_strides, self.decoder_space_upscale,
                                         wide=spec.arch == "wide")

        self.t_downscale = math.prod(encoder_strides)
        self.t_upscale = math.prod(decoder_strides)
        self.frames_to_trim = self.t_upscale - 1 if self.causal else 0
        self.run_chunk: Callable = run_chunk  # torch.compile'd by ``compile()``
        if checkpoint_path is not None:
            load_weights(self, checkpoint_path)

    def compile(self, **kwargs) -> None:
        """``torch.compile`` what every call runs (encode_video, decode_video, forward,
        streaming): the chunk of work through one block sequence, with ``fullgraph=True``
        (the blocks have no graph break). One graph per block sequence and chunk shape
        (``dynamic=False`` unless given); ``kwargs`` go to ``torch.compile`` (``mode``,
        ``backend``, ...). ``mode="reduce-overhead"`` replays CUDA graphs on GPUs."""
        compiled = torch.compile(run_chunk, fullgraph=True, **{"dynamic": False, **kwargs})

        def run(*args):  # every model, block sequence, shape and grad mode is a cache entry of run_chunk's code
            with torch._dynamo.config.patch(recompile_limit=COMPILE_CACHE_LIMIT):
                return compiled(*args)

        self.run_chunk = run

    def adapt_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fit weights trained with more temporal upscaling into a preview decoder: a TGrow
        with stride 1 keeps the output channels of the last timestep of a stride-2 TGrow,
        as the published loader does."""
        own = self.state_dict()
        adapted = dict(state_dict)
        for i, block in enumerate(self.decoder):
            key = f"decoder.{i}.conv.weight"
            if isinstance(block, TGrow) and key in adapted and adapted[key].shape[0] > own[key].shape[0]:
                adapted[key] = adapted[key][-own[key].shape[0]:]
        return adapted

    # -- frame arithmetic ---------------------------------------------------------------
    def plan(self, input_frames: int) -> FramePlan:
        """Frame counts for a clip of ``input_frames`` frames through this model."""
        return plan_frames(input_frames, self.t_downscale, self.t_upscale, self.is_cogvideox, self.h3_chunks, self.causal)

    # -- encode / decode ----------------------------------------------------------------
    def preprocess_input_frames(self, x: torch.Tensor) -> torch.Tensor:
        return F.pixel_unshuffle(x, self.patch_size) if self.patch_size > 1 else x

    def postprocess_output_frames(self, x: torch.Tensor, clamp: bool = True, in_place: bool = False) -> torch.Tensor:
        """Contiguous NTCHW frames (pixel-shuffled for patched variants), clamped to [0, 1]
        if ``clamp``; ``in_place`` may clamp ``x`` itself (a decoder output nobody else holds)."""
        x = F.pixel_shuffle(x, self.patch_size) if self.patch_size > 1 else x.contiguous()
        if not clamp:
            return x
        return x.clamp_(0, 1) if in_place and not x.requires_grad else x.clamp(0, 1)

    def encode_video(self, x: torch.Tensor, parallel: bool = True, show_progress_bar: bool = False) -> torch.Tensor:
        """Encode NTCHW frames in [0, 1] to NTCHW latents (``plan(T).latent_frames`` of them);
        ``parallel=False`` runs ``t_downscale`` frames at a time (memory flat in T)."""
        if x.ndim != 5 or x.shape[2] != self.image_channels:
            raise ValueError(f"expected NTCHW frames with {self.image_channels} channels, got shape {tuple(x.shape)}")
        _check_spatial(x.shape[-2:], 8 * self.patch_size)
        x = self.preprocess_input_frames(x)
        pad = self.plan(x.shape[1]).padded_frames - x.shape[1]
        if pad:
            x = torch.cat([x, x[:, -1:].expand(-1, pad, -1, -1, -1)], 1)
        if self.h3_chunks:
            return self.encode_h3_chunks(x, parallel, show_progress_bar)
        return run_blocks(self.encoder, x, parallel, self.t_downscale, show_progress_bar, self.run_chunk).contiguous()

    def encode_h3_chunks(self, x: torch.Tensor, parallel: bool, show_progress_bar: bool) -> torch.Tensor:
        """MiniMax H3's time axis: each 17-frame chunk of the (padded) input, after 3 zero
        frames, is encoded on its own (no memory across chunks); the last 3 latents of
        the clip are dropped (``models.frames.plan_frames``)."""
        lead = x.new_zeros(x.shape[0], H3_LEFT_PAD, *x.shape[2:])
        latents = [run_blocks(self.encoder, torch.cat([lead, chunk], 1), parallel, self.t_downscale, show_progress_bar,
                              self.run_chunk)
                   for chunk in x.split(H3_CHUNK_FRAMES, dim=1)]
        return torch.cat(latents, 1)[:, :-H3_DROPPED_LATENTS].contiguous()

    def decode_video(
        self, z: torch.Tensor, parallel: bool = True, show_progress_bar: bool = False, clamp: bool = True
    ) -> torch.Tensor:
        """Decode NTCHW latents to NTCHW frames; frame i matches input frame i.
        ``parallel=False`` runs ``latents_per_chunk`` latents at a time, then frame by
        frame after each TGrow (memory flat in T)."""
        if z.ndim != 5 or z.shape[2] != self.latent_channels:
            raise ValueError(f"expected NTCHW latents with {self.latent_channels} channels, got shape {tuple(z.shape)}")
        drop = 0 if self.h3_chunks else self._frames_to_trim(z.shape[1])  # never computed in full
        x = run_blocks(self.decoder, z, parallel, self.latents_per_chunk(z), show_progress_bar, self.run_chunk, drop)
        if self.h3_chunks:  # the first t_upscale - 1 frames of every chunk's frames go
            x = x[:, h3_kept_frames(z.shape[1], self.t_downscale, self.t_upscale)]
        return self.postprocess_output_frames(x, clamp, in_place=True)

    def latents_per_chunk(self, z: torch.Tensor) -> int:
        """Sequential decoding's chunk: as many latents as keep the first stage's
        activations within ``SEQUENTIAL_CHUNK_BYTES`` (one at video sizes; several for
        small frames, where each block's per-call cost would dominate)."""
        width = next(b.out_channels for b in self.decoder if isinstance(b, nn.Conv2d))
        return max(1, SEQUENTIAL_CHUNK_BYTES // (z.shape[0] * width * z.shape[-2] * z.shape[-1] * z.element_size()))

    def _frames_to_trim(self, latent_frames: int) -> int:
        return self.plan(latent_frames * self.t_downscale).trimmed_frames  # not for H3 (it drops per chunk)

    def forward(self, frames: torch.Tensor, reference_latents: torch.Tensor | None = None, decode_own: bool = True) -> AutoencoderOutput:
        """Training step entry point (one call, so DDP/DeepSpeed wrappers see it).

        Returns the latents of ``frames``, their decoding and, when given, the decoding of
        the reference VAE's latents; decoded frames are not clamped, so gradients flow.
        """
        latents = self.encode_video(frames)
        decoded = self.decode_video(latents, clamp=False) if decode_own else None
        from_ref = self.decode_video(reference_latents, clamp=False) if reference_latents is not None else None
        return AutoencoderOutput(latents, decoded, from_ref)

    def stream(self) -> "StreamingTAEHV":
        return StreamingTAEHV(self)


def _check_spatial(hw: Sequence[int], multiple: int) -> None:
    h, w = hw
    if h % multiple or w % multiple:
        raise ValueError(f"height and width must be multiples of {multiple} (8 * patch_size), got {h}x{w}")


class StreamingTAEHV(nn.Module):
    """Live video, with the published streaming API: feed frames, get latents; feed
    latents, get frames, one at a time; flush at the end.

        stream = model.stream()                   # or StreamingTAEHV(model)
        for frame in camera:                      # N1CHW in [0, 1]
            latent = stream.encode(frame)         # None until t_downscale frames are in
            out = stream.decode(latent) if latent is not None else None
            while out is not None:                # a latent gives t_upscale frames
                show(out)
                out = stream.decode()
        for out in stream.flush():
            show(out)

    The encoder runs once per ``t_downscale`` frames and the decoder once per latent, all
    of a chunk's frames together (sequential mode's engine). Outputs equal
    ``decode_video(encode_video(video))``; for taecvx the first ``frames_to_trim`` frames
    are dropped as for an odd latent count (the published stream keeps them), since the
    trim rule depends on the total count, unknown while streaming.
    """

    def __init__(self, taehv: TAEHV):
        super().__init__()
        if taehv.h3_chunks:
            raise NotImplementedError(
                f"{taehv.variant} cannot stream: its encoder drops the last 3 latents of a clip, which a stream only "
                "knows at its end; use encode_video / decode_video (parallel=False keeps memory flat)")
        self.taehv = taehv
        self.reset()

    def reset(self) -> None:
        """Forget everything: the next frame starts a new stream."""
        self._encoder = BlockRunner(self.taehv.encoder, self.taehv.run_chunk)
        self._decoder = BlockRunner(self.taehv.decoder, self.taehv.run_chunk)
        self._frames_in: list[torch.Tensor] = []  # preprocessed frames waiting for a full group
        self._latents_out: deque[torch.Tensor] = deque()
        self._latents_in: deque[torch.Tensor] = deque()
        self._frames_out: deque[torch.Tensor] = deque()  # raw decoder frames, returned one per call
        self.n_frames_encoded = self.n_frames_decoded = 0
        self._last_frame: torch.Tensor | None = None

    def encode(self, x: torch.Tensor | None = None) -> torch.Tensor | None:
        """Feed NTCHW frames (optional); returns the next N1CHW latent, or None while fewer
        than ``t_downscale`` frames are waiting."""
        if x is not None:
            if x.ndim != 5 or x.shape[2] != self.taehv.image_channels:
                raise ValueError(f"expected NTCHW frames with {self.taehv.image_channels} channels, got shape {tuple(x.shape)}")
            self._last_frame = x[:, -1:]
            self._frames_in += self.taehv.preprocess_input_frames(x).split(1, dim=1)
            self.n_frames_encoded += x.shape[1]
        group = self.taehv.t_downscale
        while len(self._frames_in) >= group:
            chunk, self._frames_in = torch.cat(self._frames_in[:group], 1), self._frames_in[group:]
            self._latents_out += self._encoder(chunk).split(1, dim=1)
        return self._latents_out.popleft() if self._latents_out else None

    def decode(self, x: torch.Tensor | None = None) -> torch.Tensor | None:
        """Feed NTCHW latents (optional); returns the next N1CHW frame (clamped), or None
        when every fed latent is decoded. The first ``frames_to_trim`` frames, which only
        align the decoder with the reference VAE, are never returned."""
        if x is not None:
            if x.ndim != 5 or x.shape[2] != self.taehv.latent_channels:
                raise ValueError(f"expected NTCHW latents with {self.taehv.latent_channels} channels, "
                                 f"got shape {tuple(x.shape)}")
            self._latents_in += x.split(1, dim=1)
        while True:
            if not self._frames_out and self._latents_in:
                self._frames_out += self._decoder(self._latents_in.popleft()).split(1, dim=1)
            if not self._frames_out:
                return None
            frame = self._frames_out.popleft()
            self.n_frames_decoded += 1
            if self.n_frames_decoded > self.taehv.frames_to_trim:
                return self.taehv.postprocess_output_frames(frame)

    def flush_encoder(self) -> list[torch.Tensor]:
        """Pad the last partial group of frames with copies of the last one; every latent left."""
        pad = -self.n_frames_encoded % self.taehv.t_downscale
        latents = []
        if pad and self._last_frame is not None:
            latent = self.encode(self._last_frame.expand(-1, pad, -1, -1, -1))
            latents += [latent] if latent is not None else []
        while (latent := self.encode()) is not None:
            latents.append(latent)
        return latents

    def flush_decoder(self) -> list[torch.Tensor]:
        """Every frame the fed latents still give."""
        frames = []
        while (frame := self.decode()) is not None:
            frames.append(frame)
        return frames

    def flush(self) -> list[torch.Tensor]:
        """Flush the encoder (with padding) into the decoder; every frame left."""
        frames = []
        for latent in self.flush_encoder():
            frame = self.decode(latent)
            frames += [frame] if frame is not None else []
        return frames + self.flush_decoder()
