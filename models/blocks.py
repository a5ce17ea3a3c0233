"""The published TAEHV layers (``conv``, ``Clamp``, the memory blocks, ``TPool``, ``TGrow``),
the encoder/decoder layer lists built from them, and the state a block runner keeps while
it takes a clip through them (``Work``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
from tqdm.auto import tqdm


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


# ---------------------------------------------------------------------------------------
# A run of a block sequence over a clip, kept as the published sequential runner keeps it.
# The clip goes through in chunks of frames: all of a chunk's frames pass each block
# together (time-parallel), and each memory block carries its last input frame into the
# next chunk, so every chunking gives the same frames. One chunk of the whole clip is
# parallel mode (O(T) memory); chunks of ``t_downscale`` frames (encoder) or of a few
# latents (decoder), with the frames each TGrow makes going on one at a time, are
# sequential mode and streaming (memory flat in T).


def stride_product(blocks: Sequence[nn.Module], kind: type) -> int:
    """The product of the strides of the ``kind`` blocks (TPool or TGrow) in ``blocks``
    (a plain loop: ``torch.compile`` traces it)."""
    product = 1
    for block in blocks:
        if isinstance(block, kind):
            product *= block.stride
    return product


def output_frames(blocks: Sequence[nn.Module], input_frames: int) -> int:
    """The frames ``blocks`` make of ``input_frames`` frames (a multiple of the TPool strides)."""
    return input_frames * stride_product(blocks, TGrow) // stride_product(blocks, TPool)


def split_chunks(x: torch.Tensor, chunk_frames: int | None) -> list[torch.Tensor]:
    """NTCHW frames in chunks of even sizes, at most ``chunk_frames`` each (None: one chunk)."""
    if x.ndim != 5:
        raise ValueError(f"TAEHV works on NTCHW tensors, got shape {tuple(x.shape)}")
    return [x] if chunk_frames is None else list(x.tensor_split(-(-x.shape[1] // chunk_frames), dim=1))


class Stops(NamedTuple):
    """Where a run's work items pause in a sequence of ``length`` steps: ``per_frame_from``,
    the first step after the last one that mixes frames or changes their count (there the
    trimmed frames are skipped), and ``grown``, the steps right after a TGrow of stride > 1
    (there its frames may go on one at a time)."""

    length: int
    per_frame_from: int
    grown: tuple[int, ...]


def find_stops(blocks_at: Sequence[nn.Module], mixes_frames: Sequence[bool]) -> Stops:
    """The stops of a sequence of steps: the block at each step, and whether the step mixes
    frames (TPools and TGrows of stride > 1 count without being told)."""
    per_frame_from, grown = 0, []
    for k, (block, mixes) in enumerate(zip(blocks_at, mixes_frames)):
        if mixes or (isinstance(block, (TGrow, TPool)) and block.stride > 1):
            per_frame_from = k + 1
        if isinstance(block, TGrow) and block.stride > 1:
            grown.append(k + 1)
    return Stops(len(blocks_at), per_frame_from, tuple(grown))


class Frames:
    """A run's output frames, written into one NTCHW tensor as they come, ``count`` in all
    (a first piece that holds them all is the output itself)."""

    def __init__(self, count: int):
        self.count, self.written = count, 0
        self.out: torch.Tensor | None = None

    def append(self, y: torch.Tensor | None) -> None:
        if y is None:
            return
        if self.out is None and y.shape[1] == self.count:
            self.out, self.written = y, self.count
            return
        if self.out is None:
            self.out = y.new_empty((y.shape[0], self.count, *y.shape[2:]))
        self.out[:, self.written : self.written + y.shape[1]] = y
        self.written += y.shape[1]


class WorkItem(NamedTuple):
    """Frames waiting for step ``start``: a chunk's NTCHW frames (start 0), else (N*T)CHW."""

    frames: torch.Tensor
    start: int


@dataclass(frozen=True)
class RunOptions:
    """How a block runner takes a clip through a block sequence (``models.taehv.run_blocks``):
    all frames at once, or ``chunk_frames`` at a time (TPool strides must divide it); the
    frames each TGrow makes going on one at a time if ``split_grown_frames``; the first
    ``trimmed`` output frames dropped; a progress bar over the chunks."""

    chunk_frames: int | None = None
    split_grown_frames: bool = False
    trimmed: int = 0
    show_progress_bar: bool = False


ALL_AT_ONCE = RunOptions()  # all frames together, none trimmed, no progress bar


class Work:
    """A run of a sequence of steps (blocks, or a fast path's steps) over NTCHW frames ``x``:
    a stack of work items taken in causal order (the chunks, and the frames a TGrow makes
    when ``options.split_grown_frames``), each memory block's input frame before the next item
    (``memory``, per block; None: zeros), the leading output frames still to skip
    (``options.trimmed``: the decoder's trimmed frames, which the steps from ``per_frame_from`` on
    never see) and the frames made. A runner takes an item, runs its steps up to the stop
    ``take`` gives, and puts the frames back; no side effects outside the object, so
    ``torch.compile`` takes a run whole. ``layout``: a chunk's NTCHW frames as the first
    step takes them."""

    def __init__(
        self,
        blocks: nn.Sequential,
        x: torch.Tensor,
        memory: Sequence[torch.Tensor | None] | None,
        stops: Stops,
        layout: Callable[[torch.Tensor], torch.Tensor],
        options: RunOptions,
    ):
        chunks, trimmed = split_chunks(x, options.chunk_frames), options.trimmed
        self.n, self.layout, self.trimmed = x.shape[0], layout, trimmed
        self.length, self.per_frame_from = stops.length, stops.per_frame_from
        self.grown = stops.grown if options.split_grown_frames else ()
        self.stops = sorted({stops.length, *self.grown, *((stops.per_frame_from,) if trimmed else ())})
        self.memory = [None] * len(blocks) if memory is None else list(memory)
        self.items = [WorkItem(chunk, 0) for chunk in reversed(chunks)]
        self.frames = Frames(output_frames(blocks, x.shape[1]) - trimmed)
        show = options.show_progress_bar and len(chunks) > 1
        self.progress = tqdm(total=len(chunks), desc="chunks") if show else None
        self.chunks_taken = 0

    def take(self) -> tuple[torch.Tensor, int, int] | None:
        """The next item's (N*T)CHW frames, its first step and the step it stops before;
        None when the run is done. Items at the end are output, and the trimmed frames
        skipped, on the way."""
        while self.items:
            x, start = self.items.pop()
            if start == 0:
                self.chunks_taken += 1
                if self.progress is not None and self.chunks_taken > 1:
                    self.progress.update()  # the previous chunk is done
                x = self.layout(x)
            if start == self.per_frame_from and self.trimmed:
                x = self.skip_trimmed(x)
                if x is None:
                    continue
            if start == self.length:
                self.frames.append(x.unflatten(0, (self.n, -1)))
                continue
            for stop in self.stops:
                if stop > start:
                    return x, start, stop
        return None

    def put(self, x: torch.Tensor, stop: int) -> None:
        """(N*T)CHW frames made by the steps before ``stop``: after a TGrow that splits, one
        item per frame."""
        if stop in self.grown and x.shape[0] > self.n:
            self.items += [WorkItem(frame, stop) for frame in reversed(x.unflatten(0, (self.n, -1)).unbind(1))]
        else:
            self.items.append(WorkItem(x, stop))

    def carry(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        """The memory of block ``index`` before ``x``'s (N*T)CHW frames (NCHW; None: zeros);
        ``x``'s last frame becomes it."""
        past, self.memory[index] = self.memory[index], x.unflatten(0, (self.n, -1))[:, -1].clone()
        return past

    def skip_trimmed(self, x: torch.Tensor) -> torch.Tensor | None:
        """(N*T)CHW frames without the leading ones still to skip; None if none is left."""
        frames = x.shape[0] // self.n
        skip = min(self.trimmed, frames)
        self.trimmed -= skip
        return None if skip == frames else x.unflatten(0, (self.n, frames))[:, skip:].flatten(0, 1)

    def result(self) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """The NTCHW output frames (None if all were skipped) and the memory after them."""
        if self.progress is not None:
            self.progress.update()
            self.progress.close()
        return self.frames.out, self.memory
