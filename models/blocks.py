"""The published TAEHV layers (``conv``, ``Clamp``, the memory blocks, ``TPool``, ``TGrow``),
the encoder/decoder layer lists built from them, and the steps a block runner takes over
them (``Step``: the published block calls, or a fast path's fused steps)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn as nn


def conv(n_in: int, n_out: int, **kwargs) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, **kwargs)


ACTIVATIONS = ("relu", "leaky_relu")  # VariantSpec.activation


def activation(name: str = "relu") -> nn.Module:
    """The network's nonlinearity: the published ReLU, or LeakyReLU(0.2) (LightX2V's lighttaehy1_5)."""
    if name == "relu":
        return nn.ReLU(inplace=True)
    if name == "leaky_relu":
        return nn.LeakyReLU(0.2, inplace=True)
    raise ValueError(f"unknown activation {name!r}; known: {', '.join(ACTIVATIONS)}")


class Clamp(nn.Module):
    """Soft clamp of decoder inputs to about [-3, 3]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class MemBlock(nn.Module):
    """Residual conv block that also sees its own input from the previous timestep."""

    def __init__(self, n_in: int, n_out: int, act: str = "relu"):
        super().__init__()
        self.conv = nn.Sequential(
            conv(n_in * 2, n_out), activation(act), conv(n_out, n_out), activation(act), conv(n_out, n_out)
        )
        self.skip = nn.Conv2d(n_in, n_out, 1, bias=False) if n_in != n_out else nn.Identity()
        self.act = activation(act)

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(torch.cat([x, past], 1)) + self.skip(x))


class SuperMemBlock(nn.Module):
    """ConvNeXt-style memory block of the "super" decoder: 7x7 depthwise, expand, project."""

    def __init__(self, n_f: int, expansion: int = 2, act: str = "relu"):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(n_f * 2, n_f * 2, 7, padding=3, groups=n_f * 2, bias=False),
            nn.Conv2d(n_f * 2, n_f * 2 * expansion, 1),
            activation(act),
            nn.Conv2d(n_f * 2 * expansion, n_f, 1, bias=False),
        )

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([x, past], 1)) + x


class WideMemBlock(nn.Module):
    """Memory block of the wide decoder: 1x1 mix of frame and past, grouped 3x3 (64
    channels per group), 1x1, grouped 3x3; a 1x1 skip when the widths differ."""

    def __init__(self, n_in: int, n_out: int, act: str = "relu", group_width: int = 64):
        super().__init__()
        groups = n_out // group_width
        self.conv = nn.Sequential(
            nn.Conv2d(n_in * 2, n_out, 1),
            activation(act),
            conv(n_out, n_out, groups=groups),
            activation(act),
            nn.Conv2d(n_out, n_out, 1),
            activation(act),
            conv(n_out, n_out, groups=groups),
        )
        self.skip = nn.Conv2d(n_in, n_out, 1, bias=False) if n_in != n_out else nn.Identity()
        self.act = activation(act)

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(torch.cat([x, past], 1)) + self.skip(x))


MEMORY_BLOCKS = (MemBlock, SuperMemBlock, WideMemBlock)


def frames_to_channels(x: torch.Tensor, stride: int) -> torch.Tensor:
    """(N*T, C, H, W) -> (N*T/stride, stride*C, H, W), consecutive frames side by side on
    channels, in ``x``'s memory format (a view for contiguous tensors, one copy for
    channels-last ones)."""
    nt, c, h, w = x.shape
    if stride == 1 or not is_channels_last(x):
        return x.reshape(nt // stride, stride * c, h, w)
    out = torch.empty(
        (nt // stride, stride * c, h, w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last
    )
    out.view(nt // stride, stride, c, h, w).copy_(x.view(nt // stride, stride, c, h, w))
    return out


def channels_to_frames(x: torch.Tensor, stride: int) -> torch.Tensor:
    """The inverse of ``frames_to_channels``."""
    n, sc, h, w = x.shape
    if stride == 1 or not is_channels_last(x):
        return x.reshape(n * stride, sc // stride, h, w)
    out = torch.empty(
        (n * stride, sc // stride, h, w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last
    )
    out.view(n, stride, sc // stride, h, w).copy_(x.view(n, stride, sc // stride, h, w))
    return out


def is_channels_last(x: torch.Tensor) -> bool:
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


def build_encoder(
    in_channels: int, latent_channels: int, time_strides: Sequence[int], act: str = "relu"
) -> nn.Sequential:
    stages = []
    for stride in time_strides:
        stages += [TPool(64, stride), conv(64, 64, stride=2, bias=False)]
        stages += [MemBlock(64, 64, act) for _ in range(3)]
    return nn.Sequential(conv(in_channels, 64), activation(act), *stages, conv(64, latent_channels))


def build_decoder(
    latent_channels: int,
    out_channels: int,
    time_strides: Sequence[int],
    space_upscale: Sequence[bool],
    wide: bool = False,
    act: str = "relu",
) -> nn.Sequential:
    n_f, block = ([1024, 512, 256, 64], WideMemBlock) if wide else ([256, 128, 64, 64], MemBlock)
    stages = []
    for i, (t_up, s_up) in enumerate(zip(time_strides, space_upscale)):
        stages += [block(n_f[i], n_f[i], act) for _ in range(3)]
        stages += [
            nn.Upsample(scale_factor=2 if s_up else 1),
            TGrow(n_f[i], t_up),
            conv(n_f[i], n_f[i + 1], bias=False),
        ]
    return nn.Sequential(
        Clamp(),
        conv(latent_channels, n_f[0]),
        activation(act),
        *stages,
        activation(act),
        conv(n_f[3], out_channels),
    )


def build_super_decoder(
    latent_channels: int,
    out_channels: int,
    time_strides: Sequence[int],
    space_upscale: Sequence[bool],
    act: str = "relu",
) -> nn.Sequential:
    n_f = [512, 256, 128, 64]
    stages = []
    for i, (t_up, s_up) in enumerate(zip(time_strides, space_upscale)):
        r = 2 if s_up else 1
        stages += [SuperMemBlock(n_f[i], act=act) for _ in range(3)]
        stages += [conv(n_f[i], n_f[i + 1] * r * r), activation(act), nn.PixelShuffle(r), TGrow(n_f[i + 1], t_up)]
    return nn.Sequential(nn.Conv2d(latent_channels, n_f[0], 1, bias=False), *stages, conv(n_f[3], out_channels))


class Kind(Enum):
    """What a step of a block schedule runs."""

    BLOCK = "block"  # block(x)
    MEMORY = "memory"  # block(x, past), past carried across chunks
    CONV = "conv"  # fast paths: a conv and (``relu``) the ReLU after it
    UPSAMPLE_CONV = "upsample_conv"  # fast paths: Upsample(2) (its TGrow run first, at low resolution), 3x3 conv
    POOL_CONV = "pool_conv"  # fast paths: a TPool and the bias-free conv after it
    STEM = "stem"  # fast paths: the encoder's conv, ReLU, TPool and stride-2 conv


@dataclass(frozen=True)
class Step:
    """One step of a block schedule: ``kind``, from ``blocks[index]`` on."""

    index: int
    kind: Kind = Kind.BLOCK
    relu: bool = False  # the ReLU after the step's last conv is folded in
    parity_major: bool = False  # POOL_CONV: frame k of every group of frames is the k-th block of the input


TEMPORAL_KINDS = (Kind.MEMORY, Kind.POOL_CONV, Kind.STEM)  # steps that mix frames (so do TPools and TGrows)


def plain_step(index: int, block: nn.Module) -> Step:
    return Step(index, Kind.MEMORY if isinstance(block, MEMORY_BLOCKS) else Kind.BLOCK)
