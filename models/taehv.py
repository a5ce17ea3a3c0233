"""TAEHV: Tiny AutoEncoder for Hunyuan Video (and TAECVX, TAEW2.x, TAEHV1.5, TAEH3, TAELTX2.x).

State-dict keys, shapes and outputs match the published ``taehv.py``, so the published
weight files load here and weights trained here load there. Layout per model:

    encoder: conv, ReLU, 3 x [TPool, conv/2, MemBlock x3], conv -> latent
    decoder: Clamp, conv, ReLU, 3 x [MemBlock x3, Upsample, TGrow, conv], ReLU, conv
    wide decoder: the same with widths 1024/512/256/64 and WideMemBlocks
    super decoder: conv1x1, 3 x [SuperMemBlock x3, conv, ReLU, PixelShuffle, TGrow], conv

TAELTX pools and grows time in all three stages (8x); TAEH3 encodes 17-frame chunks
on their own; LightX2V's lighttaehy1_5 has LeakyReLU(0.2) for every ReLU and works on
pixels in [-1, 1] (mapped from and to [0, 1] here). Videos are NTCHW tensors in [0, 1];
latents are the reference VAE's in the TAE's latent space (``latent_space``: raw, scaled
or normalised, ``models.latent_spaces``). Frame counts follow ``VariantSpec.plan``.

Published name -> here:
    conv, Clamp, MemBlock, SuperMemBlock, WideMemBlock, TPool, TGrow -> the same
    the layer lists in TAEHV.__init__ -> build_encoder, build_decoder, build_super_decoder
    apply_model_with_memblocks(_parallel, _sequential) -> run_blocks
    apply_model_with_memblocks_sequential_single_step, TWorkItem -> models.blocks.Work, WorkItem
    StreamingTAEHV's chunk at a time -> BlockStream
    TAEHV.patch_tgrow_layers -> TAEHV.adapt_state_dict (used by models.weights.load_weights)
    TAEHV._encode_h3_video / _decode_h3_video -> encode_h3_chunks / decode_video's h3_kept_frames
    TAEHV.encode_video, decode_video, preprocess_input_frames, postprocess_output_frames,
    StreamingTAEHV (encode, decode, flush_encoder, flush_decoder, flush, reset) -> the same
    main() -> inference.py

One block runner (``run_blocks``) serves every call: all frames of a chunk pass each block
together, and memory blocks carry their last input to the next chunk. Each block sequence's
CPU fast paths (fused fp32 inference, the CPU training schedule; ReLU networks only) are
made once when the model is built (``models.fast_paths.prepare``); each call chooses its
path from its input: on GPUs, under ``torch.compile`` and in dtypes other than fp32 it
runs the blocks' ``forward``s; on CPU a fast path takes the whole run, without calling
the memory blocks' and folded convolutions' ``forward``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from . import fast_paths
from .blocks import (
    ALL_AT_ONCE,
    MEMORY_BLOCKS,
    Frames,
    RunOptions,
    TGrow,
    Work,
    build_decoder,
    build_encoder,
    build_super_decoder,
    find_stops,
    output_frames,
    split_chunks,
)
from .fast_ops import OneDNN
from .frames import (
    H3_CHUNK_FRAMES,
    H3_DROPPED_LATENTS,
    H3_LEFT_PAD,
    FramePlan,
    first_latent_frames,
    h3_kept_frames,
    plan_frames,
)
from .vae_registry import file_space
from .variants import resolve_variant, time_strides, time_switches
from .weights import FORMAT_NAME, load_weights, read_metadata, run_config_hint

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------
# Running a block sequence over a clip (the published ``apply_model_with_memblocks``; how
# chunks, memory and trimmed frames go: ``models.blocks.Work``).


def past_frames(x: torch.Tensor, n: int, first: torch.Tensor | None) -> torch.Tensor:
    """Each of the (N*T)CHW frames' predecessor, ``first`` (NCHW; None: zeros, empty
    memory) before the first frame of each of the N sequences, in ``x``'s memory format."""
    past = torch.empty_like(x)
    shifted = past.unflatten(0, (n, -1))
    shifted[:, 0] = 0 if first is None else first
    shifted[:, 1:] = x.unflatten(0, (n, -1))[:, :-1]
    return past


def run_blocks(
    blocks: nn.Sequential,
    x: torch.Tensor,
    memory: Sequence[torch.Tensor | None] | None = None,
    options: RunOptions = ALL_AT_ONCE,
    onednn: OneDNN | None = None,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """Apply ``blocks`` to NTCHW frames as ``options`` say (all at once, or in chunks with
    memory flat in T; ``models.blocks.RunOptions``). Returns the NTCHW output frames without
    the first ``options.trimmed`` (which the blocks after the last temporal one never see;
    None if that is all of them) and ``memory`` after them (per block, the memory block's
    last input frame; None: zeros, as at the start). The path is chosen once per run: a CPU
    fast path of ``models.fast_paths`` takes the whole run (``onednn``: its fused state when
    that outlives the run), else each block's ``forward``."""
    keep_weights = options.chunk_frames is not None or options.split_grown_frames
    fast = fast_paths.choose(blocks, x, onednn, keep_weights)
    if fast is not None:
        return fast.run(blocks, x, memory, options)
    n, stops = x.shape[0], find_stops(blocks, [isinstance(block, MEMORY_BLOCKS) for block in blocks])
    work = Work(blocks, x, memory, stops, flatten_frames, options)
    while (item := work.take()) is not None:
        x, start, stop = item
        for i in range(start, stop):
            block = blocks[i]
            if isinstance(block, MEMORY_BLOCKS):
                x = block(x, past_frames(x, n, work.carry(i, x)))
            else:
                x = block(x)
        work.put(x, stop)
    return work.result()


def flatten_frames(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(0, 1)


class BlockStream:
    """``blocks`` over the chunks of a clip as they come, one ``run`` call per chunk (the
    streaming API; a compiled model, one graph per chunk shape): the memory, the fused
    path's derived weights and the leading frames still to skip carried between calls."""

    def __init__(
        self,
        blocks: nn.Sequential,
        run: Callable = run_blocks,
        split_grown_frames: bool = True,
        trimmed: int = 0,
        memory: Sequence[torch.Tensor | None] | None = None,
    ):
        self.blocks, self.run, self.split_grown_frames, self.trimmed = blocks, run, split_grown_frames, trimmed
        self.memory = [None] * len(blocks) if memory is None else list(memory)
        self.onednn = OneDNN(keep=True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The chunk's NTCHW output frames (None while all of them are skipped)."""
        trimmed = min(self.trimmed, output_frames(self.blocks, x.shape[1]))
        options = RunOptions(split_grown_frames=self.split_grown_frames, trimmed=trimmed)
        y, self.memory = self.run(self.blocks, x, self.memory, options, self.onednn)
        self.trimmed -= trimmed
        return y


def run_per_chunk(
    run_chunk: Callable,
    blocks: nn.Sequential,
    x: torch.Tensor,
    memory: Sequence[torch.Tensor | None] | None = None,
    options: RunOptions = ALL_AT_ONCE,
    onednn: OneDNN | None = None,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """``run_blocks`` with ``run_chunk`` (``run_blocks``'s signature) called on one chunk
    at a time: a compiled ``run_blocks`` makes one graph per chunk shape, not per clip."""
    stream = BlockStream(blocks, run_chunk, options.split_grown_frames, options.trimmed, memory)
    chunks = split_chunks(x, options.chunk_frames)
    frames = Frames(output_frames(blocks, x.shape[1]) - options.trimmed)
    for chunk in tqdm(chunks, desc="chunks", disable=not options.show_progress_bar or len(chunks) == 1):
        frames.append(stream(chunk))
    return frames.out, stream.memory


SEQUENTIAL_CHUNK_BYTES = 1 << 20  # sequential decoding's first-stage activations per chunk (see latents_per_chunk)


class AutoencoderOutput(NamedTuple):
    """What ``TAEHV.forward`` returns for training (decoded frames unclamped)."""

    latents: torch.Tensor
    decoded: torch.Tensor | None
    decoded_from_reference: torch.Tensor | None


PUBLISHED_DEFAULT_CHECKPOINT = "taehv.pth"
COMPILE_CACHE_LIMIT = 64  # compiled graphs of run_blocks kept (dynamo's default, 8, is hit by training + validation)
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
                "taew2_2", "taehv1_5_super", "taeh3", "taeltx2_3", "taeltx2_3_wide",
                "lighttaehy1_5", ...).
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
        # a file without our metadata (a .pth) of one of our runs: its run says the variant and space
        described = bool(metadata and metadata.get("format") == FORMAT_NAME)
        run_config = run_config_hint(checkpoint_path) if checkpoint_path is not None and not described else None
        if variant is None and run_config and run_config.get("variant", "auto") != "auto":
            variant = run_config["variant"]
        spec = resolve_variant(variant, checkpoint_path, patch_size, latent_channels, arch_variant, metadata)
        encoder_time_downscale = (
            spec.encoder_time_downscale if encoder_time_downscale is None else encoder_time_downscale
        )
        decoder_time_upscale = spec.decoder_time_upscale if decoder_time_upscale is None else decoder_time_upscale
        if len(decoder_time_upscale) == 2:
            decoder_time_upscale = (False, *decoder_time_upscale)
        self.spec = spec
        self.variant = spec.name
        self.patch_size = spec.patch_size
        self.latent_channels = spec.latent_channels
        self.arch_variant = spec.arch_variant
        self.is_cogvideox = spec.is_cogvideox
        self.h3_chunks = self.is_h3 = spec.h3_chunks
        self.image_channels = spec.image_channels
        self.causal = spec.causal
        self.activation = spec.activation
        self.signed_pixels = spec.signed_pixels
        # which latents it encodes to and decodes from, and the reference statistics it was trained with
        stem = Path(checkpoint_path).stem if checkpoint_path is not None else ""
        self.latent_space, self.latent_transform = file_space(spec.name, metadata, stem, run_config)
        encoder_strides, decoder_strides = time_strides(encoder_time_downscale), time_strides(decoder_time_upscale)
        self.encoder_time_downscale = time_switches(encoder_strides)  # booleans as published; strides where a 3 is
        self.decoder_time_upscale = time_switches(decoder_strides)
        self.decoder_space_upscale = tuple(bool(v) for v in decoder_space_upscale)

        pixels = self.image_channels * self.patch_size**2
        self.encoder = build_encoder(pixels, self.latent_channels, encoder_strides, spec.activation)
        if spec.arch_variant == "super":
            self.decoder = build_super_decoder(
                self.latent_channels, pixels, decoder_strides, self.decoder_space_upscale, spec.activation
            )
        else:
            self.decoder = build_decoder(
                self.latent_channels,
                pixels,
                decoder_strides,
                self.decoder_space_upscale,
                wide=spec.arch_variant == "wide",
                act=spec.activation,
            )

        self.t_downscale = math.prod(encoder_strides)
        self.t_upscale = math.prod(decoder_strides)
        self.frames_to_trim = self.t_upscale - 1 if self.causal else 0
        fast_paths.prepare(self.encoder)
        fast_paths.prepare(self.decoder)
        self.run_blocks: Callable = run_blocks  # torch.compile'd by ``compile()``
        if checkpoint_path is not None:
            load_weights(self, checkpoint_path)

    def compile(self, **kwargs) -> None:
        """``torch.compile`` what every call runs (encode_video, decode_video, forward,
        streaming): ``run_blocks`` on one chunk at a time, with ``fullgraph=True`` (the
        blocks have no graph break). One graph per block sequence and chunk shape
        (``dynamic=False`` unless given); ``kwargs`` go to ``torch.compile`` (``mode``,
        ``backend``, ...). ``mode="reduce-overhead"`` replays CUDA graphs on GPUs.

        Each compilation's time is logged (the first call of a block sequence, shape and
        grad mode). A compilation that fails (no C compiler or Triton, a backend error)
        leaves the model eager from then on, with one warning that says why: the results
        are the same, only slower."""
        compiled = torch.compile(run_blocks, fullgraph=True, **{"dynamic": False, **kwargs})
        seen: set[tuple] = set()

        def run_chunk(blocks: nn.Sequential, x: torch.Tensor, memory, options: RunOptions, *_):
            # every model, block sequence, shape and grad mode is a cache entry of run_blocks's code
            key = (id(blocks), tuple(x.shape), x.dtype, torch.is_grad_enabled())
            started = time.perf_counter()
            try:
                with torch._dynamo.config.patch(recompile_limit=COMPILE_CACHE_LIMIT):
                    y, memory = compiled(blocks, x, memory, options)
            except torch._dynamo.exc.TorchDynamoException as err:
                cause = getattr(err, "inner_exception", None) or err  # a backend's own error, else dynamo's
                reason = (str(cause).strip().splitlines() or [""])[0]
                logger.warning("torch.compile failed (%s: %s): running eager from now on", type(cause).__name__, reason)
                self.run_blocks = run_blocks
                return run_blocks(blocks, x, memory, options)
            if key not in seen:
                seen.add(key)
                logger.info(
                    "torch.compile: compiled a %d-block sequence for %s %s%s in %.1f s",
                    len(blocks),
                    "x".join(map(str, x.shape)),
                    str(x.dtype).removeprefix("torch."),
                    " with gradients" if key[-1] else "",
                    time.perf_counter() - started,
                )
            # CUDA graphs reuse their output buffers on the next call
            return (None if y is None else y.clone()), [None if m is None else m.clone() for m in memory]

        self.run_blocks = functools.partial(run_per_chunk, run_chunk)

    @property
    def compiled(self) -> bool:
        """Whether calls run the ``torch.compile``'d blocks (``compile()``, not since fallen back)."""
        return self.run_blocks is not run_blocks

    def run_eager(self, reason: str) -> None:
        """Leave the compiled blocks for good (a compilation that failed where ``compile()``'s
        own fallback cannot see it: the backward pass, a kernel's first launch), saying why once."""
        if self.compiled:
            logger.warning("torch.compile failed (%s): running eager from now on", reason)
            self.run_blocks = run_blocks

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Run eager inside the block whatever ``compile()`` did (a one-off shape, such as a
        placeholder clip, that is not worth a compilation)."""
        compiled, self.run_blocks = self.run_blocks, run_blocks
        try:
            yield
        finally:
            self.run_blocks = compiled

    def adapt_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fit weights trained with more temporal upscaling into a preview decoder: a TGrow
        with stride 1 keeps the output channels of the last timestep of a stride-2 TGrow,
        as the published loader does."""
        own = self.state_dict()
        adapted = dict(state_dict)
        for i, block in enumerate(self.decoder):
            key = f"decoder.{i}.conv.weight"
            if isinstance(block, TGrow) and key in adapted and adapted[key].shape[0] > own[key].shape[0]:
                adapted[key] = adapted[key][-own[key].shape[0] :]
        return adapted

    # -- frame arithmetic ---------------------------------------------------------------
    def plan(self, input_frames: int) -> FramePlan:
        """Frame counts for a clip of ``input_frames`` frames through this model."""
        return plan_frames(
            input_frames, self.t_downscale, self.t_upscale, self.is_cogvideox, self.h3_chunks, self.causal
        )

    def first_latent_frames(self) -> int:
        """Frames the first latent gives decoded on its own (``models.frames.first_latent_frames``)."""
        return first_latent_frames(self.t_downscale, self.t_upscale, self.is_cogvideox, self.h3_chunks, self.causal)

    # -- encode / decode ----------------------------------------------------------------
    def preprocess_input_frames(self, x: torch.Tensor) -> torch.Tensor:
        """Frames in [0, 1] as the encoder takes them: mapped to [-1, 1] for ``signed_pixels``
        (lighttaehy1_5, as ComfyUI feeds it), then pixel-unshuffled for patched variants."""
        if self.signed_pixels:
            x = x * 2 - 1
        return F.pixel_unshuffle(x, self.patch_size) if self.patch_size > 1 else x

    def postprocess_output_frames(self, x: torch.Tensor, clamp: bool = True, in_place: bool = False) -> torch.Tensor:
        """Contiguous NTCHW frames (pixel-shuffled for patched variants) in [0, 1]: mapped
        from [-1, 1] for ``signed_pixels`` (the clamp then equals LightX2V's to [-1, 1]),
        clamped to [0, 1] if ``clamp``; ``in_place`` may change ``x`` itself (a decoder
        output nobody else holds)."""
        x = F.pixel_shuffle(x, self.patch_size) if self.patch_size > 1 else x.contiguous()
        if self.signed_pixels:
            x = (x.add_(1) if in_place and not x.requires_grad else x + 1).div_(2)
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
        latents, _ = self.run_blocks(self.encoder, x, None, self._encoding(parallel, show_progress_bar))
        return latents.contiguous()

    def encode_h3_chunks(self, x: torch.Tensor, parallel: bool, show_progress_bar: bool) -> torch.Tensor:
        """MiniMax H3's time axis: each 17-frame chunk of the (padded) input, after 3 zero
        frames, is encoded on its own (no memory across chunks); the last 3 latents of
        the clip are dropped (``models.frames.plan_frames``)."""
        lead = x.new_zeros(x.shape[0], H3_LEFT_PAD, *x.shape[2:])
        options, latents = self._encoding(parallel, show_progress_bar), []
        for chunk in x.split(H3_CHUNK_FRAMES, dim=1):  # a loop, not a comprehension: one frame less to each conv
            z, _ = self.run_blocks(self.encoder, torch.cat([lead, chunk], 1), None, options)
            latents.append(z)
        return torch.cat(latents, 1)[:, :-H3_DROPPED_LATENTS].contiguous()

    def _encoding(self, parallel: bool, show_progress_bar: bool) -> RunOptions:
        """The encoder's run: all frames at once, or ``t_downscale`` frames at a time."""
        return RunOptions(None if parallel else self.t_downscale, not parallel, 0, show_progress_bar)

    def decode_video(
        self, z: torch.Tensor, parallel: bool = True, show_progress_bar: bool = False, clamp: bool = True
    ) -> torch.Tensor:
        """Decode NTCHW latents to NTCHW frames; frame i matches input frame i.
        ``parallel=False`` runs ``latents_per_chunk`` latents at a time, then frame by
        frame after each TGrow (memory flat in T)."""
        if z.ndim != 5 or z.shape[2] != self.latent_channels:
            raise ValueError(f"expected NTCHW latents with {self.latent_channels} channels, got shape {tuple(z.shape)}")
        trimmed = 0 if self.h3_chunks else self._frames_to_trim(z.shape[1])  # never computed in full
        options = RunOptions(None if parallel else self.latents_per_chunk(z), not parallel, trimmed, show_progress_bar)
        x, _ = self.run_blocks(self.decoder, z, None, options)
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

    def forward(
        self, frames: torch.Tensor, reference_latents: torch.Tensor | None = None, decode_own: bool = True
    ) -> AutoencoderOutput:
        """Training step entry point (one call, so DDP/DeepSpeed wrappers see it).

        Returns the latents of ``frames``, their decoding and, when given, the decoding of
        the reference VAE's latents; decoded frames are not clamped, so gradients flow.
        """
        latents = self.encode_video(frames)
        decoded = self.decode_video(latents, clamp=False) if decode_own else None
        from_ref = self.decode_video(reference_latents, clamp=False) if reference_latents is not None else None
        return AutoencoderOutput(latents, decoded, from_ref)

    def stream(self) -> StreamingTAEHV:
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
                "knows at its end; use encode_video / decode_video (parallel=False keeps memory flat)"
            )
        self.taehv = taehv
        self.reset()

    def reset(self) -> None:
        """Forget everything: the next frame starts a new stream."""
        self._encoder = BlockStream(self.taehv.encoder, self.taehv.run_blocks)
        self._decoder = BlockStream(self.taehv.decoder, self.taehv.run_blocks)
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
                raise ValueError(
                    f"expected NTCHW frames with {self.taehv.image_channels} channels, got shape {tuple(x.shape)}"
                )
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
                raise ValueError(
                    f"expected NTCHW latents with {self.taehv.latent_channels} channels, got shape {tuple(x.shape)}"
                )
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
