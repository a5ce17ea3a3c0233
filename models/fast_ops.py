"""The operations of the CPU fast paths (``models.fast_paths``): convolutions with their
bias, ReLU and residual fused into one oneDNN call, and the folded block groups (a memory
block's conv stack, TPool + conv, Upsample + 3x3 conv, the encoder's stem in row bands).
Each takes ``onednn`` (the fused inference path's state) or None: then the same
arithmetic runs as plain differentiable ops, the derived weights made inside autograd so
the gradients reach the published parameters (the CPU training path)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .blocks import SuperMemBlock, TPool, frames_to_channels, is_channels_last

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
