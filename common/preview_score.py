"""The preview score: how good the picture a live preview shows is, shared by validation
and inference.

Most people see a TAE as the live preview while a video model samples. ComfyUI's previewer
(Comfy-Org/ComfyUI ``latent_preview.py`` at 2d619ed9, ``TAEHVPreviewerImpl.
decode_latent_to_preview``, line 56) decodes ``x0[:1, :, :1]``: the first latent frame of the
denoised estimate, alone, with no temporal context; its TAE (``comfy/taesd/taehv.py`` at
7ef46f66, ``TAEHV.decode``) trims the ``t_upscale - 1`` frames before the first, so one frame
is shown. The whole-clip score averages every frame
and says little about that one. Here the first latent is decoded alone the same way and
scored against the frames it stands for (``models.frames.first_latent_frames``: the clip's
first frame for a causal TAE). A causal decoder's first frames depend on the first latent
only, so this is also the whole-clip decode's first frame(s); decoding alone keeps the score
what the previewer does for any decoder.
"""

from __future__ import annotations

import torch

from taehv_train.common.metrics import video_psnr, video_ssim
from taehv_train.models.taehv import TAEHV


def preview_decode(model: TAEHV, latents: torch.Tensor, parallel: bool = True) -> torch.Tensor:
    """The first latent frame of NTCHW ``latents`` decoded on its own: the frames a live
    preview shows (``model.first_latent_frames()`` of them)."""
    return model.decode_video(latents[:, :1], parallel=parallel)


def preview_scores(preview: torch.Tensor, frames: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-clip PSNR and SSIM, shape (N,), of ``preview_decode``'s frames against the first
    frames of ``frames`` (NTCHW in [0, 1], frame i matching input frame i: the input clip, or
    another decoder's decode of it), in fp32 (outside autocast: the callers decode inside it)."""
    shown = min(preview.shape[1], frames.shape[1])
    decoded, target = preview[:, :shown].float(), frames[:, :shown].float()
    return {"psnr": video_psnr(decoded, target), "ssim": video_ssim(decoded, target)}
