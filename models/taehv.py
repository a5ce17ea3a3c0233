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
"""
from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from .checkpoint import load_weights, read_metadata
from .frames import H3_CHUNK_FRAMES, H3_DROPPED_LATENTS, H3_LEFT_PAD, FramePlan, h3_kept_frames, plan_frames
from .variants import resolve_variant

logger = logging.getLogger(__name__)


def conv(n_in: int, n_out: int, **kwargs) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, **kwargs)


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

    def forward_stacked(self, x: torch.Tensor, x_and_past: torch.Tensor) -> torch.Tensor:
        """``forward`` given ``cat([x, past], 1)``, which ``run_parallel`` builds in one copy."""
        y = self.conv(x_and_past)
        y += self.skip(x)  # in place: the conv's backward does not need its output
        return self.act(y)


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

    def forward_stacked(self, x: torch.Tensor, x_and_past: torch.Tensor) -> torch.Tensor:
        y = self.conv(x_and_past)
        y += x
        return y


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


class TPool(nn.Module):
    """Temporal pooling: ``stride`` consecutive frames stacked on channels, then 1x1 conv."""

    def __init__(self, n_f: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(n_f * stride, n_f, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, c, h, w = x.shape
        return self.conv(x.reshape(-1, self.stride * c, h, w))


class TGrow(nn.Module):
    """Temporal upsampling: 1x1 conv to ``stride`` times the channels, split into frames."""

    def __init__(self, n_f: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(n_f, n_f * stride, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, c, h, w = x.shape
        return self.conv(x).reshape(-1, c, h, w)


def build_encoder(in_channels: int, latent_channels: int, time_downscale: Sequence[bool]) -> nn.Sequential:
    stages = []
    for down in time_downscale:
        stages += [TPool(64, 2 if down else 1), conv(64, 64, stride=2, bias=False)]
        stages += [MemBlock(64, 64) for _ in range(3)]
    return nn.Sequential(conv(in_channels, 64), nn.ReLU(inplace=True), *stages, conv(64, latent_channels))


def build_decoder(latent_channels: int, out_channels: int, time_upscale: Sequence[bool], space_upscale: Sequence[bool],
                  wide: bool = False) -> nn.Sequential:
    n_f, block = ([1024, 512, 256, 64], WideMemBlock) if wide else ([256, 128, 64, 64], MemBlock)
    stages = []
    for i, (t_up, s_up) in enumerate(zip(time_upscale, space_upscale)):
        stages += [block(n_f[i], n_f[i]) for _ in range(3)]
        stages += [nn.Upsample(scale_factor=2 if s_up else 1), TGrow(n_f[i], 2 if t_up else 1), conv(n_f[i], n_f[i + 1], bias=False)]
    return nn.Sequential(
        Clamp(), conv(latent_channels, n_f[0]), nn.ReLU(inplace=True), *stages, nn.ReLU(inplace=True), conv(n_f[3], out_channels)
    )


def build_super_decoder(latent_channels: int, out_channels: int, time_upscale: Sequence[bool], space_upscale: Sequence[bool]) -> nn.Sequential:
    if not all(space_upscale):
        raise NotImplementedError("the 'super' decoder upsamples with PixelShuffle and cannot disable spatial upscaling")
    n_f = [512, 256, 128, 64]
    stages = []
    for i, t_up in enumerate(time_upscale):
        stages += [SuperMemBlock(n_f[i]) for _ in range(3)]
        stages += [nn.Conv2d(n_f[i], n_f[i + 1] * 4, 3, padding=1), nn.PixelShuffle(2), nn.ReLU(inplace=True)]
        stages += [TGrow(n_f[i + 1], 2 if t_up else 1)]
    return nn.Sequential(nn.Conv2d(latent_channels, n_f[0], 1, bias=False), *stages, conv(n_f[3], out_channels))


# ---------------------------------------------------------------------------------------
# Running a block sequence over time: in parallel (all frames at once, O(T) memory) or
# step by step (O(1) memory in T, also the engine behind streaming).


def with_past(x: torch.Tensor, n: int) -> torch.Tensor:
    """``cat([x, past], 1)`` for (N*T)CHW frames, ``past`` being each frame's predecessor
    (zeros before the first), written in one copy in ``x``'s memory format."""
    nt, c, h, w = x.shape
    channels_last = not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty((nt, 2 * c, h, w), dtype=x.dtype, device=x.device, memory_format=fmt)
    seq, stacked = x.view(n, nt // n, c, h, w), out.view(n, nt // n, 2 * c, h, w)
    stacked[:, :, :c] = seq
    stacked[:, :1, c:] = 0
    stacked[:, 1:, c:] = seq[:, :-1]
    return out


def run_parallel(blocks: nn.Sequential, x: torch.Tensor, show_progress_bar: bool = False) -> torch.Tensor:
    """Apply ``blocks`` to an NTCHW tensor, all timesteps at once."""
    n, t, c, h, w = x.shape
    x = x.reshape(n * t, c, h, w)
    for block in tqdm(blocks, disable=not show_progress_bar, desc="blocks"):
        x = block.forward_stacked(x, with_past(x, n)) if isinstance(block, MEMORY_BLOCKS) else block(x)
    nt, c, h, w = x.shape
    return x.view(n, nt // n, c, h, w)


class SequentialRunner:
    """Step-by-step evaluation of a block sequence: one frame in, frames out when ready.

    The sequence is a graph over (timestep, block): TPool waits for ``stride`` inputs,
    TGrow emits ``stride`` outputs, memory blocks remember their previous input. Work is
    visited depth-first so each frame leaves as soon as it can, and only one state tensor
    per block is kept: memory does not grow with the number of frames.
    """

    def __init__(self, blocks: nn.Sequential):
        self.blocks = blocks
        self.queue: deque[tuple[torch.Tensor, int]] = deque()
        self.memory: list = [None] * len(blocks)

    def push(self, frame: torch.Tensor) -> None:
        """Queue one NCHW input frame."""
        self.queue.append((frame, 0))

    def pull(self) -> torch.Tensor | None:
        """Run until one NCHW output frame is ready; None when more input is needed."""
        blocks, memory = self.blocks, self.memory
        while self.queue:
            x, i = self.queue.popleft()
            if i == len(blocks):
                return x
            block = blocks[i]
            if isinstance(block, MEMORY_BLOCKS):
                past = memory[i] if memory[i] is not None else torch.zeros_like(x)
                memory[i] = x
                self.queue.appendleft((block(x, past), i + 1))
            elif isinstance(block, TPool):
                pending = memory[i] = (memory[i] or []) + [x]
                if len(pending) == block.stride:
                    memory[i] = None
                    self.queue.appendleft((block(torch.stack(pending, 1).flatten(0, 1)), i + 1))
            elif isinstance(block, TGrow):
                y = block(x)
                for frame in reversed(y.view(x.shape[0], block.stride, *y.shape[1:]).unbind(1)):
                    self.queue.appendleft((frame, i + 1))
            else:
                self.queue.appendleft((block(x), i + 1))
        return None

    def drain(self) -> Iterator[torch.Tensor]:
        while (y := self.pull()) is not None:
            yield y


def run_sequential(blocks: nn.Sequential, x: torch.Tensor, show_progress_bar: bool = False) -> torch.Tensor:
    """Apply ``blocks`` to an NTCHW tensor one timestep at a time (memory flat in T)."""
    runner = SequentialRunner(blocks)
    out = []
    for frame in tqdm(x.unbind(1), disable=not show_progress_bar, desc="frames"):
        runner.push(frame)
        out.extend(runner.drain())
    return torch.stack(out, 1)


def run_blocks(blocks: nn.Sequential, x: torch.Tensor, parallel: bool, show_progress_bar: bool = False) -> torch.Tensor:
    if x.ndim != 5:
        raise ValueError(f"TAEHV works on NTCHW tensors, got shape {tuple(x.shape)}")
    return (run_parallel if parallel else run_sequential)(blocks, x, show_progress_bar)


# ---------------------------------------------------------------------------------------


class AutoencoderOutput(NamedTuple):
    """What ``TAEHV.forward`` returns for training (decoded frames unclamped)."""

    latents: torch.Tensor
    decoded: torch.Tensor | None
    decoded_from_reference: torch.Tensor | None


class TAEHV(nn.Module):
    def __init__(
        self,
        checkpoint_path: str | os.PathLike | None = None,
        encoder_time_downscale: Sequence[bool] | None = None,
        decoder_time_upscale: Sequence[bool] | None = None,
        decoder_space_upscale: Sequence[bool] = (True, True, True),
        patch_size: int = 1,
        latent_channels: int = 16,
        arch_variant: str = "base",
        variant: str | None = None,
    ):
        """Build a TAEHV and optionally load published or trained weights.

        Args:
            checkpoint_path: ``.pth`` or ``.safetensors`` weights; None builds a fresh model.
            encoder_time_downscale / decoder_time_upscale / decoder_space_upscale: per-stage
                switches (None: the variant's); a 2-tuple ``decoder_time_upscale`` gets
                ``False`` prepended. Fewer upscales give a cheaper preview decoder that
                still loads full weights.
            patch_size, latent_channels, arch_variant ("base", "super" or "wide"):
                architecture, used when neither ``variant`` nor the checkpoint says otherwise.
            variant: explicit variant name ("taehv", "taecvx", "taehv1_5", "taew2_2",
                "taehv1_5_super", "taeh3", "taeltx2_3", "taeltx2_3_wide", ...). Without it
                the variant comes from the safetensors metadata or the file name, as users
                name the published files.
        """
        super().__init__()
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
        self.h3_chunks = spec.h3_chunks
        self.image_channels = 3
        self.encoder_time_downscale = tuple(bool(v) for v in encoder_time_downscale)
        self.decoder_time_upscale = tuple(bool(v) for v in decoder_time_upscale)
        self.decoder_space_upscale = tuple(bool(v) for v in decoder_space_upscale)

        pixels = self.image_channels * self.patch_size**2
        self.encoder = build_encoder(pixels, self.latent_channels, self.encoder_time_downscale)
        if spec.arch == "super":
            self.decoder = build_super_decoder(self.latent_channels, pixels, self.decoder_time_upscale,
                                               self.decoder_space_upscale)
        else:
            self.decoder = build_decoder(self.latent_channels, pixels, self.decoder_time_upscale,
                                         self.decoder_space_upscale, wide=spec.arch == "wide")

        self.t_downscale = 2 ** sum(b.stride == 2 for b in self.encoder if isinstance(b, TPool))
        self.t_upscale = 2 ** sum(b.stride == 2 for b in self.decoder if isinstance(b, TGrow))
        self.frames_to_trim = self.t_upscale - 1
        if checkpoint_path is not None:
            load_weights(self, checkpoint_path)

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
        return plan_frames(input_frames, self.t_downscale, self.t_upscale, self.is_cogvideox, self.h3_chunks)

    # -- encode / decode ----------------------------------------------------------------
    def preprocess_input_frames(self, x: torch.Tensor) -> torch.Tensor:
        return F.pixel_unshuffle(x, self.patch_size) if self.patch_size > 1 else x

    def postprocess_output_frames(self, x: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        if self.patch_size > 1:
            x = F.pixel_shuffle(x, self.patch_size)
        return x.clamp(0, 1) if clamp else x

    def encode_video(self, x: torch.Tensor, parallel: bool = True, show_progress_bar: bool = False) -> torch.Tensor:
        """Encode NTCHW frames in [0, 1] to NTCHW latents (``plan(T).latent_frames`` of them)."""
        if x.ndim != 5 or x.shape[2] != self.image_channels:
            raise ValueError(f"expected NTCHW RGB frames, got shape {tuple(x.shape)}")
        _check_spatial(x.shape[-2:], 8 * self.patch_size)
        x = self.preprocess_input_frames(x)
        pad = self.plan(x.shape[1]).padded_frames - x.shape[1]
        if pad:
            x = torch.cat([x, x[:, -1:].expand(-1, pad, -1, -1, -1)], 1)
        if self.h3_chunks:
            return self.encode_h3_chunks(x, parallel, show_progress_bar)
        return run_blocks(self.encoder, x, parallel, show_progress_bar)

    def encode_h3_chunks(self, x: torch.Tensor, parallel: bool, show_progress_bar: bool) -> torch.Tensor:
        """MiniMax H3's time axis: each 17-frame chunk of the (padded) input, after 3 zero
        frames, is encoded on its own (no memory across chunks); the last 3 latents of
        the clip are dropped (``models.frames.plan_frames``)."""
        lead = x.new_zeros(x.shape[0], H3_LEFT_PAD, *x.shape[2:])
        latents = [run_blocks(self.encoder, torch.cat([lead, chunk], 1), parallel, show_progress_bar)
                   for chunk in x.split(H3_CHUNK_FRAMES, dim=1)]
        return torch.cat(latents, 1)[:, :-H3_DROPPED_LATENTS]

    def decode_video(
        self, z: torch.Tensor, parallel: bool = True, show_progress_bar: bool = False, clamp: bool = True
    ) -> torch.Tensor:
        """Decode NTCHW latents to NTCHW frames; frame i matches input frame i."""
        if z.ndim != 5 or z.shape[2] != self.latent_channels:
            raise ValueError(f"expected NTCHW latents with {self.latent_channels} channels, got shape {tuple(z.shape)}")
        x = run_blocks(self.decoder, z, parallel, show_progress_bar)
        if self.h3_chunks:  # the first t_upscale - 1 frames of every chunk's frames go
            return self.postprocess_output_frames(x[:, h3_kept_frames(z.shape[1], self.t_downscale, self.t_upscale)], clamp)
        return self.postprocess_output_frames(x[:, self._frames_to_trim(z.shape[1]):], clamp)

    def _frames_to_trim(self, latent_frames: int) -> int:
        return plan_frames(latent_frames * self.t_downscale, self.t_downscale, self.t_upscale, self.is_cogvideox).trimmed_frames

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
        if self.h3_chunks:
            raise NotImplementedError(
                f"{self.variant} cannot stream: its encoder drops the last 3 latents of a clip, which a stream only "
                "knows at its end; use encode_video / decode_video (parallel=False keeps memory flat)")
        return StreamingTAEHV(self)


def _check_spatial(hw: Sequence[int], multiple: int) -> None:
    h, w = hw
    if h % multiple or w % multiple:
        raise ValueError(f"height and width must be multiples of {multiple} (8 * patch_size), got {h}x{w}")


class StreamingTAEHV:
    """Live video: feed frames, get latents; feed latents, get frames; flush at the end.

        stream = model.stream()
        for frame in camera:                      # N1CHW in [0, 1]
            for latent in stream.encode(frame):   # usually empty: 4 frames -> 1 latent
                for out in stream.decode(latent):
                    show(out)
        for out in stream.flush():
            show(out)

    Outputs equal ``decode_video(encode_video(video))`` (for taecvx only when the latent
    count is odd: its trim rule depends on the total count, unknown while streaming).
    """

    def __init__(self, model: TAEHV):
        self.model = model
        self.reset()

    def reset(self) -> None:
        self._encoder = SequentialRunner(self.model.encoder)
        self._decoder = SequentialRunner(self.model.decoder)
        self._frames_in = 0
        self._frames_out = 0
        self._last_frame: torch.Tensor | None = None

    def encode(self, frames: torch.Tensor) -> list[torch.Tensor]:
        """Feed N,T,C,H,W frames (T >= 1); returns the N1CHW latents that became ready."""
        self._last_frame = frames[:, -1:]
        latents = []
        for frame in self.model.preprocess_input_frames(frames).unbind(1):
            self._encoder.push(frame)
            self._frames_in += 1
            latents += [z.unsqueeze(1) for z in self._encoder.drain()]
        return latents

    def decode(self, latents: torch.Tensor) -> list[torch.Tensor]:
        """Feed N,T,C,H,W latents; returns the N1CHW frames (clamped) that became ready."""
        out = []
        for z in latents.unbind(1):
            self._decoder.push(z)
            for x in self._decoder.drain():
                self._frames_out += 1
                if self._frames_out > self.model.frames_to_trim:
                    out.append(self.model.postprocess_output_frames(x.unsqueeze(1)))
        return out

    def flush(self) -> list[torch.Tensor]:
        """Pad the last partial group of frames, encode and decode everything pending."""
        out = []
        pad = -self._frames_in % self.model.t_downscale
        if pad and self._last_frame is not None:
            for latent in self.encode(self._last_frame.expand(-1, pad, -1, -1, -1)):
                out += self.decode(latent)
        return out
