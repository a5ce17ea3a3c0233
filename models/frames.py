"""Frame arithmetic: the one place that says how many frames go in and come out.

Input frames -> latents -> decoded frames -> which input frame each decoded frame matches.
Training targets, Seraena grouping, validation metrics and inference all ask this module;
nobody slices ``[:, :-3]`` by hand (that crashes or misaligns for 4k+1 frame counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FramePlan:
    """How a clip of ``input_frames`` frames travels through a TAEHV model.

    Decoded frame ``i`` corresponds to input frame ``i``. Inputs are padded at the end with
    copies of the last frame up to a multiple of ``t_downscale``; ``aligned_frames`` counts
    the decoded frames that match a real (not padded) input frame.
    """

    input_frames: int
    padded_frames: int
    latent_frames: int
    raw_decoded_frames: int
    trimmed_frames: int
    decoded_frames: int
    aligned_frames: int

    @property
    def exact(self) -> bool:
        """True when every decoded frame matches a real input frame and none is left over."""
        return self.decoded_frames == self.aligned_frames == self.input_frames

    def target(self, frames: torch.Tensor) -> torch.Tensor:
        """Input frames (NTCHW) aligned with the decoded frames: ``frames[:, :decoded]``.

        When the decoder returns more frames than there are inputs (taecvx with an even
        latent count and T not a multiple of 4), the extra decoded frames match the padding,
        i.e. copies of the last input frame, exactly as the encoder saw them.
        """
        if frames.shape[1] != self.input_frames:
            raise ValueError(f"plan is for {self.input_frames} frames, got a clip of {frames.shape[1]}")
        if self.decoded_frames <= self.input_frames:
            return frames[:, : self.decoded_frames]
        pad = frames[:, -1:].expand(-1, self.decoded_frames - self.input_frames, *frames.shape[2:])
        return torch.cat([frames, pad], 1)

    def aligned(self, decoded: torch.Tensor, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(decoded, input) restricted to the decoded frames that match a real input frame:
        what metrics compare (frame i with frame i, padding excluded)."""
        if decoded.shape[1] != self.decoded_frames or frames.shape[1] != self.input_frames:
            raise ValueError(
                f"plan is for {self.input_frames} -> {self.decoded_frames} frames, "
                f"got {frames.shape[1]} -> {decoded.shape[1]}"
            )
        return decoded[:, : self.aligned_frames], frames[:, : self.aligned_frames]


H3_CHUNK_FRAMES, H3_LEFT_PAD, H3_DROPPED_LATENTS = 17, 3, 3  # MiniMax H3's chunked time axis


def plan_frames(
    input_frames: int,
    t_downscale: int = 4,
    t_upscale: int = 4,
    is_cogvideox: bool = False,
    h3_chunks: bool = False,
    causal: bool = True,
) -> FramePlan:
    """Frame counts for a clip of ``input_frames`` frames.

    ``T -> ceil(T / t_downscale)`` latents ``-> latents * t_upscale`` raw decoded frames, of
    which the first ``t_upscale - 1`` are trimmed (they precede the first input frame).
    The CogVideoX variant (taecvx) keeps them when the latent count is even, so that its
    frame counts match CogVideoX's VAE. A TAE of a non-causal VAE (Allegro: T = 4L both
    ways) trims nothing.

    MiniMax H3 (``h3_chunks``) cuts time into chunks of 17 frames (the clip padded at the
    end with copies of its last frame), each encoded on its own after 3 zero frames
    (20 frames, 5 latents), and drops the last 3 latents; its decoder drops the first
    ``t_upscale - 1`` frames of every 5 latents' frames (``h3_decoded_frames``). So
    ``c`` chunks give ``5c - 3`` latents and ``17c - 12`` frames: 17 -> 2 -> 5,
    34 -> 7 -> 22.
    """
    if input_frames < 1:
        raise ValueError(f"need at least one input frame, got {input_frames}")
    if h3_chunks:
        chunks = math.ceil(input_frames / H3_CHUNK_FRAMES)
        latents = chunks * (H3_CHUNK_FRAMES + H3_LEFT_PAD) // t_downscale - H3_DROPPED_LATENTS
        raw = latents * t_upscale
        decoded = h3_decoded_frames(latents, t_downscale, t_upscale)
        return FramePlan(
            input_frames=input_frames,
            padded_frames=chunks * H3_CHUNK_FRAMES,
            latent_frames=latents,
            raw_decoded_frames=raw,
            trimmed_frames=raw - decoded,
            decoded_frames=decoded,
            aligned_frames=min(decoded, input_frames),
        )
    latents = math.ceil(input_frames / t_downscale)
    raw = latents * t_upscale
    trim = 0 if (is_cogvideox and latents % 2 == 0) or not causal else t_upscale - 1
    decoded = raw - trim
    return FramePlan(
        input_frames=input_frames,
        padded_frames=latents * t_downscale,
        latent_frames=latents,
        raw_decoded_frames=raw,
        trimmed_frames=trim,
        decoded_frames=decoded,
        aligned_frames=min(decoded, input_frames),
    )


OS13_CHUNK_FRAMES = 17  # Open-Sora 1.3's micro_frame_size: the frames its VAE encodes at once
OS13_CHUNK_LATENTS = (OS13_CHUNK_FRAMES - 1) // 4 + 1  # its micro_z_frame_size: one chunk's latents


def opensora13_latent_frames(input_frames: int) -> int:
    """How many latents Open-Sora 1.3's pipeline samples for a clip of ``input_frames``
    frames, as its 1.3 configs run its VAE (``micro_frame_size=17``, ``temporal_overlap=True``:
    hpcaitech/Open-Sora tag v1.3, ``configs/opensora-v1-3/inference/t2v.py``, lines 29 and 33):
    one for a single frame, else 5 for every whole 16 frames after the first
    (``opensora/models/vae_v1_3/vae.py`` get_latent_size, lines 70-79, whose size
    ``scripts/inference.py`` samples its noise at, lines 96 and 283).

    That is its VAE's chunked time axis: a clip is cut into chunks of 17 frames that start
    every 16 frames, each sharing its first frame with the chunk before, and each chunk is
    encoded on its own to 5 latents (encode_micro_frame, lines 100-102); the decoder takes
    the latents back 5 at a time, 17 frames each, and averages the shared frames
    (decode_micro_frame, lines 171-183): 16k + 1 frames -> 5k latents -> 16k + 1 frames.
    taeos1_3 encodes a clip as one sequence (``plan_frames``: ceil(T / 4) latents):
    ``opensora13_agrees`` says where the two meet.
    """
    if input_frames < 1:
        raise ValueError(f"need at least one input frame, got {input_frames}")
    if input_frames == 1:
        return 1
    return (input_frames - 1) // (OS13_CHUNK_FRAMES - 1) * OS13_CHUNK_LATENTS


def opensora13_agrees(input_frames: int) -> bool:
    """Whether taeos1_3's latents of a clip of ``input_frames`` frames line up with Open-Sora
    1.3's (``opensora13_latent_frames``): for one frame, and for one chunk (17 to 20 frames,
    whose 5 latents both decode to its first 17) only; past one chunk Open-Sora's latents
    restart at each shared frame where the TAE's run on, even where the counts match (37
    frames: 10 latents each, of 33 frames and of 37)."""
    ours = plan_frames(input_frames).latent_frames
    return input_frames == 1 or ours == opensora13_latent_frames(input_frames) == OS13_CHUNK_LATENTS


def h3_kept_frames(latent_frames: int, t_downscale: int = 4, t_upscale: int = 4) -> list[int]:
    """Which of the ``latent_frames * t_upscale`` raw decoded frames H3 keeps: all but the
    first ``t_upscale - 1`` of each chunk's frames (one chunk: 20 frames / t_downscale
    latents)."""
    chunk = (H3_CHUNK_FRAMES + H3_LEFT_PAD) // t_downscale * t_upscale
    return [i for i in range(latent_frames * t_upscale) if i % chunk >= t_upscale - 1]


def h3_decoded_frames(latent_frames: int, t_downscale: int = 4, t_upscale: int = 4) -> int:
    return len(h3_kept_frames(latent_frames, t_downscale, t_upscale))


def first_latent_frames(
    t_downscale: int = 4,
    t_upscale: int = 4,
    is_cogvideox: bool = False,
    h3_chunks: bool = False,
    causal: bool = True,
) -> int:
    """How many frames the first latent gives when decoded on its own, as a live preview
    decodes it (ComfyUI's previewer: one latent frame, no temporal context). As in every
    decode, decoded frame i matches input frame i, so they stand for the clip's first frames:
    one for a causal TAE (the ``t_upscale - 1`` before it are trimmed; H3 drops them per
    chunk), ``t_upscale`` for a non-causal one."""
    if h3_chunks:
        return h3_decoded_frames(1, t_downscale, t_upscale)
    return plan_frames(t_downscale, t_downscale, t_upscale, is_cogvideox, False, causal).decoded_frames


def exact_frame_counts(
    limit: int,
    t_downscale: int = 4,
    t_upscale: int = 4,
    is_cogvideox: bool = False,
    h3_chunks: bool = False,
    causal: bool = True,
) -> list[int]:
    """Input frame counts up to ``limit`` for which decoding returns exactly the input frames."""
    return [
        t for t in range(1, limit + 1) if plan_frames(t, t_downscale, t_upscale, is_cogvideox, h3_chunks, causal).exact
    ]


def group_frames(frames: torch.Tensor, group: int) -> torch.Tensor:
    """(N, T, C, H, W) -> (N * T/group, group*C, H, W): ``group`` consecutive frames stacked
    on channels (Seraena's samples). T must be a multiple of ``group``: nothing is trimmed."""
    n, t, c, h, w = frames.shape
    if t % group:
        raise ValueError(
            f"{t} frames do not split into groups of {group}; valid group sizes: {', '.join(map(str, group_sizes(t)))}"
        )
    return frames.reshape(n * (t // group), group * c, h, w)


def ungroup_frames(groups: torch.Tensor, group: int, frames: int) -> torch.Tensor:
    """The exact inverse of ``group_frames`` for clips of ``frames`` frames."""
    g, gc, h, w = groups.shape
    if gc % group or g * group % frames:
        raise ValueError(f"{tuple(groups.shape)} is not a grouping of {frames}-frame clips by {group}")
    return groups.reshape(g * group // frames, frames, gc // group, h, w)


def group_sizes(frames: int) -> list[int]:
    """Group sizes that split ``frames`` decoded frames without a remainder."""
    return [g for g in range(1, frames + 1) if frames % g == 0]
