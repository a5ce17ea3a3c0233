"""Reconstruction metrics on aligned frames, named and ordered once for validation and
inference (``ReconstructionMetrics``), and the latent RMS ratio (the model's latents
against the reference VAE's: training logs it, inference reports it).

Inputs are NTCHW videos in [0, 1] whose frame i already corresponds (see
``models.frames.FramePlan.target``); metrics average over all frames of a video.

Every metric is computed over chunks of frames (with torchmetrics where it has the metric)
and combined exactly (sums of squared errors, frame-weighted means of per-frame averages),
so its temporaries are bounded by one chunk, not by the clip's length: long or large clips
cost no more than the video tensors themselves. ``chunk_frames=None`` sizes chunks to about ``CHUNK_ELEMENTS`` values.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# torchmetrics is imported where a metric is computed: its import pulls in transformers
# (about 1.5 s of a process's start), which a run stopped by its config or data check never uses.

# Values per chunk of frames. torchmetrics' SSIM holds ~60 times its input in temporaries
# (163 MB for one 360x640 frame, measured on CPU), so 2**20 values (one 360x640 frame, 21
# frames at 128x128) keep a chunk's metrics near 250 MB, while small clips stay one chunk.
CHUNK_ELEMENTS = 2**20


def frame_chunks(video: torch.Tensor, chunk_frames: int | None = None) -> list[slice]:
    """Slices over the frames of a TCHW ``video``, ``chunk_frames`` long (default: as many
    frames as fit in ``CHUNK_ELEMENTS`` values, at least one)."""
    size = chunk_frames or max(1, CHUNK_ELEMENTS // video[0].numel())
    return [slice(start, min(start + size, len(video))) for start in range(0, len(video), size)]


def _frame_squared_errors(p: torch.Tensor, t: torch.Tensor, chunk_frames: int | None) -> torch.Tensor:
    """Sum of squared errors of each frame (T,) of one TCHW video, chunk by chunk."""
    return torch.cat([(p[s].float() - t[s].float()).square_().flatten(1).sum(1) for s in frame_chunks(p, chunk_frames)])


def _frame_weighted_mean(
    metric: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    p: torch.Tensor,
    t: torch.Tensor,
    chunk_frames: int | None,
) -> torch.Tensor:
    """Mean over the frames of one TCHW video of a ``metric`` that returns the mean of its
    per-frame values for a batch of frames: chunk means weighted by their frame counts."""
    total = sum(metric(p[s].float(), t[s].float()) * (s.stop - s.start) for s in frame_chunks(p, chunk_frames))
    return total / len(p)


def video_mse(pred: torch.Tensor, target: torch.Tensor, chunk_frames: int | None = None) -> torch.Tensor:
    """Per-video MSE (N,)."""
    return torch.stack([_frame_squared_errors(p, t, chunk_frames).sum() / p.numel() for p, t in zip(pred, target)])


def video_psnr(pred: torch.Tensor, target: torch.Tensor, chunk_frames: int | None = None) -> torch.Tensor:
    """Per-video PSNR in dB over all its frames (N,), data range 1: from the video's MSE
    (torchmetrics sums the squared errors over the chunks), not a mean of per-frame PSNRs."""
    from torchmetrics.image import PeakSignalNoiseRatio

    values = []
    for p, t in zip(pred, target):
        # one video on this rank: no syncing with the other ranks, which have their own videos
        metric = PeakSignalNoiseRatio(data_range=1.0, sync_on_compute=False).to(p.device)
        for chunk in frame_chunks(p, chunk_frames):
            metric.update(p[chunk].float(), t[chunk].float())
        values.append(metric.compute())
    return torch.stack(values)


def video_alpha_psnr(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-video PSNR (N,) of the alpha channel alone of NTCHW RGBA videos."""
    return video_psnr(pred[:, :, 3:], target[:, :, 3:])


def frame_psnr(pred: torch.Tensor, target: torch.Tensor, chunk_frames: int | None = None) -> torch.Tensor:
    """Per-frame PSNR in dB (N, T), data range 1: where in a clip reconstruction fails."""
    from torchmetrics.functional.image import peak_signal_noise_ratio

    return torch.stack(
        [
            torch.cat(
                [
                    peak_signal_noise_ratio(p[s].float(), t[s].float(), data_range=1.0, reduction="none", dim=(1, 2, 3))
                    for s in frame_chunks(p, chunk_frames)
                ]
            )
            for p, t in zip(pred, target)
        ]
    )


def _ssim(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """torchmetrics' SSIM of a batch of frames: the mean of the per-frame SSIMs."""
    from torchmetrics.functional.image import structural_similarity_index_measure

    return structural_similarity_index_measure(pred, target, data_range=1.0)


def video_ssim(pred: torch.Tensor, target: torch.Tensor, chunk_frames: int | None = None) -> torch.Tensor:
    """Per-video SSIM (Gaussian window 11) averaged over frames (N,)."""
    return torch.stack([_frame_weighted_mean(_ssim, p, t, chunk_frames) for p, t in zip(pred, target)])


LAPLACIAN = torch.tensor([[0.0, 1, 0], [1, -4, 1], [0, 1, 0]])


def _high_frequency_energy(video: torch.Tensor, chunk: slice) -> torch.Tensor:
    """Summed squared Laplacian of the colours of a chunk of TCHW frames (the alpha of RGBA
    frames left out): the energy of the finest detail, edges and texture."""
    frames = video[chunk, :3].float()
    kernel = LAPLACIAN.to(frames.device).expand(frames.shape[1], 1, 3, 3)
    return F.conv2d(frames, kernel, groups=frames.shape[1]).square_().sum()


def video_sharpness(pred: torch.Tensor, target: torch.Tensor, chunk_frames: int | None = None) -> torch.Tensor:
    """Per-video share of the original's high-frequency energy that the reconstruction keeps
    (N,): 1 as sharp as the original, below 1 blurred (PSNR rewards blur; this does not),
    above 1 detail the original lacks (noise, ringing). Needs no downloaded weights."""
    values = []
    for p, t in zip(pred, target):
        chunks = frame_chunks(p, chunk_frames)
        kept = sum(_high_frequency_energy(p, s) for s in chunks)
        values.append(kept / sum(_high_frequency_energy(t, s) for s in chunks).clamp_min(1e-12))
    return torch.stack(values)


def _temporal_abs_error(p: torch.Tensor, t: torch.Tensor, chunk: slice) -> torch.Tensor:
    """Summed absolute error of the frame-to-frame differences ending in ``chunk``: the
    chunk starts one frame early, so the difference across a chunk boundary counts once."""
    frames = slice(max(chunk.start - 1, 0), chunk.stop)
    return (p[frames].float().diff(dim=0) - t[frames].float().diff(dim=0)).abs_().sum()


def video_temporal_error(pred: torch.Tensor, target: torch.Tensor, chunk_frames: int | None = None) -> torch.Tensor:
    """Per-video mean absolute error of frame-to-frame differences (N,): flicker and
    motion errors that per-frame metrics miss. Zero for a single frame."""
    if pred.shape[1] < 2:
        return pred.new_zeros(pred.shape[0], dtype=torch.float32)
    return torch.stack(
        [
            sum(_temporal_abs_error(p, t, s) for s in frame_chunks(p, chunk_frames)) / p[1:].numel()
            for p, t in zip(pred, target)
        ]
    )


def rms(latents: torch.Tensor) -> torch.Tensor:
    return latents.detach().float().square().mean().sqrt()


def rms_ratio(model_latents: torch.Tensor, reference_latents: torch.Tensor) -> torch.Tensor:
    """RMS of the model's latents over the reference VAE's (1 when on the same scale)."""
    return rms(model_latents) / rms(reference_latents).clamp_min(1e-12)


CPU_WHEELS = "https://download.pytorch.org/whl/cpu"  # PyTorch's CPU-only builds, torchvision's among them


def lpips_fix() -> str:
    """The command that adds LPIPS here: requirements-lpips.txt (torchvision paired with
    requirements.txt's torch); beside a CPU-only torch build (``+cpu``), from PyTorch's CPU
    wheels, since PyPI's torchvision is built for the CUDA torch and fails to load beside it."""
    extra = f" --extra-index-url {CPU_WHEELS}" if torch.__version__.endswith("+cpu") else ""
    return f"pip install -r requirements-lpips.txt{extra}"


@functools.cache
def lpips_unavailable_reason() -> str | None:
    """None when torchmetrics' LPIPS can be built here, else why not, with the one fix.

    LPIPS is an optional extra: only a missing module counts as "unavailable" (torchvision
    not installed, for which torchmetrics' constructor raises ModuleNotFoundError, or no
    LPIPS module in torchmetrics). The reason names one fix: torchmetrics' own message offers
    others, which install a torchvision paired with another torch. The callers say it once,
    before any progress bar (inference.py, and training at start-up when it validates). Any
    other error, e.g. backbone weights that cannot be loaded, propagates with its own message.
    """
    try:
        from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity

        LearnedPerceptualImagePatchSimilarity(net_type="alex", normalize=True)
    except ImportError as err:  # ModuleNotFoundError is a subclass
        missing = "torchvision is not installed" if importlib.util.find_spec("torchvision") is None else str(err)
        return f"{missing} (to add it: {lpips_fix()})"
    return None


@functools.cache
def _lpips_model(device: str):
    from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity

    return LearnedPerceptualImagePatchSimilarity(net_type="alex", normalize=True, reduction="mean").to(device).eval()


def video_lpips(pred: torch.Tensor, target: torch.Tensor, chunk_frames: int | None = None) -> torch.Tensor:
    """Per-video LPIPS (N,), averaged over frames, of the colours (an RGBA video's alpha is left
    out: the network sees RGB images); only call when ``lpips_unavailable_reason()`` is None."""
    model = _lpips_model(str(pred.device))

    def lpips(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # the mean over a batch of frames
        return model(p[:, :3].clamp(0, 1), t[:, :3].clamp(0, 1))

    return torch.stack([_frame_weighted_mean(lpips, p, t, chunk_frames) for p, t in zip(pred, target)])


@dataclass(frozen=True)
class ReconstructionMetrics:
    """The reconstruction metrics a caller reports and their order: the one place that names
    them, for validation's columns (``val/<name>``) and inference's metrics.json alike, so
    the two report the same numbers for the same frames.

    ``own`` names the caller's own per-video values of the clip (validation's preview
    scores), listed after the sharpness, before the alpha's PSNR and LPIPS."""

    rgba: bool  # four channels: the metrics cover all four, the alpha's PSNR is added
    lpips: bool  # only when ``lpips_unavailable_reason()`` is None
    temporal: bool = False  # the frame-to-frame error and the per-frame PSNR (inference's report)
    own: tuple[str, ...] = ()

    def _table(self) -> list[tuple[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None]]:
        """(name, metric) in order; None where the caller gives the value (``own``)."""
        table = [("mse", video_mse), ("psnr", video_psnr), ("ssim", video_ssim), ("sharpness", video_sharpness)]
        if self.temporal:
            table += [("temporal_error", video_temporal_error), ("psnr_per_frame", frame_psnr)]
        table += [(name, None) for name in self.own]
        if self.rgba:
            table.append(("alpha_psnr", video_alpha_psnr))
        if self.lpips:
            table.append(("lpips", video_lpips))
        return table

    @property
    def names(self) -> list[str]:
        """The names, in order, without computing anything (a rank with no clips needs them)."""
        return [name for name, _ in self._table()]

    def __call__(
        self, decoded: torch.Tensor, target: torch.Tensor, own: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Each metric of NTCHW ``decoded`` against ``target`` by name: per video (N,), per frame
        (N, T) for ``psnr_per_frame``; ``own`` gives the values of the caller's own names."""
        own = own or {}
        return {name: own[name] if metric is None else metric(decoded, target) for name, metric in self._table()}
