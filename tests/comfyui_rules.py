"""ComfyUI's rules for a TAE file, emulated from its sources in our own words: which latent
format ``comfy/sd.py`` gives a file by its shapes and dtype, what the latent formats of
``comfy/latent_formats.py`` do to latents, and which file of ``models/vae_approx`` its live
preview takes (``latent_preview.py``). The constants are as ComfyUI lists them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

# the model files folder_paths.get_filename_list lists (folder_paths.py, supported_pt_extensions)
MODEL_EXTENSIONS = (".ckpt", ".pt", ".pt2", ".bin", ".pth", ".safetensors", ".pkl", ".sft")


def load_torch_file(path: Path) -> dict[str, torch.Tensor]:
    """A weight file's tensors, as comfy/utils.py ``load_torch_file`` reads them: safetensors
    by suffix, anything else as a torch pickle."""
    if path.suffix in (".safetensors", ".sft"):
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def comfyui_takes(state_dict: dict[str, torch.Tensor]) -> tuple[str, str]:
    """(activation, latent format) ComfyUI builds for a TAE file: comfy/sd.py, the
    ``"decoder.22.bias" in sd`` branch (Comfy-Org/ComfyUI 35ead008, ``VAE.__init__``; upstream
    fe2511468d6b L760-787 before its MiniMax H3 case), and comfy/taesd/taehv.py ``TAEHV.__init__``
    (LeakyReLU for 32 channels)."""
    channels = state_dict["decoder.1.weight"].shape[1]
    outputs = state_dict["decoder.22.bias"].shape[0]
    if channels == 24 and outputs == 12:  # "MiniMax H3": latent_format=None
        return "relu", "none"
    if channels in (48, 128):  # "Wan 2.2 and LTX2": latent_format=None
        return "relu", "none"
    if channels == 32 and outputs == 12:  # lighttae_hv15
        return "leaky_relu", "HunyuanVideo15"
    # "taehv currently only available in float16, so assume it's not lighttaew2_1"
    return "relu", "HunyuanVideo" if state_dict["decoder.1.weight"].dtype == torch.float16 else "none"


@dataclass(frozen=True)
class LatentFormat:
    """A ComfyUI latent format's ``process_in`` (its LATENT -> the sampler's space) and
    ``process_out`` (back): ``(z - mean) * scale / std`` and its inverse, per channel of
    NTCHW latents (comfy/latent_formats.py, ``LatentFormat`` and ``Wan21.process_in``)."""

    scale: float = 1.0
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def _stats(self, z: torch.Tensor) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        if self.mean is None:
            return 0.0, 1.0
        mean, std = (torch.tensor(v, dtype=z.dtype).view(1, 1, -1, 1, 1) for v in (self.mean, self.std))
        return mean, std

    def process_in(self, z: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(z)
        return (z - mean) * self.scale / std

    def process_out(self, z: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(z)
        return z * std / self.scale + mean


# Comfy-Org/ComfyUI comfy/latent_formats.py at 9a9a69fd
WAN21_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508)
WAN21_MEAN += (0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743)
WAN21_STD += (3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)
WAN22_MEAN = (-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891)
WAN22_MEAN += (0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502)
WAN22_MEAN += (-0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723)
WAN22_MEAN += (-0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667)
WAN22_STD = (0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901)
WAN22_STD += (0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659)
WAN22_STD += (0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944)
WAN22_STD += (0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744)
FORMATS = {
    "none": LatentFormat(),  # a TAE file without a latent format: process_in is the identity
    "HunyuanVideo": LatentFormat(0.476986),
    "HunyuanVideo15": LatentFormat(1.03682),
    "Wan21": LatentFormat(1.0, WAN21_MEAN, WAN21_STD),
    "Wan22": LatentFormat(1.0, WAN22_MEAN, WAN22_STD),
    "MiniMaxH3Video": LatentFormat(1.0),
    "LTXV": LatentFormat(1.0),
    "CogVideoX": LatentFormat(0.7),  # CogVideoX1_5 (the 5b-class checkpoints)
}
# taesd_decoder_name of each format that names one (comfy/latent_formats.py at 9a9a69fd)
PREVIEW_NAMES = {
    "HunyuanVideo": "taehv",
    "Wan21": "lighttaew2_1",
    "Wan22": "lighttaew2_2",
    "HunyuanVideo15": "lighttaehy1_5",
    "MiniMaxH3Video": "taeh3",
}


def previewer_file(file_names: list[str], latent_format: str) -> str | None:
    """The file of ``models/vae_approx`` ComfyUI's live preview loads for a model: latent_preview.py
    ``get_previewer`` takes the first of ``folder_paths.get_filename_list("vae_approx")`` (model
    files, sorted) whose name starts with the format's ``taesd_decoder_name``; none without one."""
    prefix = PREVIEW_NAMES.get(latent_format)
    listed = sorted(name for name in file_names if name.endswith(MODEL_EXTENSIONS))
    return next((name for name in listed if name.startswith(prefix)), None) if prefix else None


def preview_latents(x0: torch.Tensor, latent_format: str) -> torch.Tensor:
    """What ComfyUI's live preview hands a video TAE's VAE: the first latent frame of the first
    clip of the sampler's denoised estimate ``x0`` (NTCHW here; ComfyUI's is NCTHW, ``x0[:1, :, :1]``),
    taken back out of the model's space by its format's ``process_out`` (Comfy-Org/ComfyUI
    latent_preview.py at 2d619ed9, ``TAEHVPreviewerImpl.decode_latent_to_preview``, line 56).
    The file's VAE then applies its own format's ``process_in`` (comfy/taesd/taehv.py
    ``TAEHV.decode``), as for VAEDecode."""
    return FORMATS[latent_format].process_out(x0[:1, :1])
