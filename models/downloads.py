"""Where the weights a config or a tool names come from, and the command that fetches each
to the path asked for. Every missing-weights message ends in ``fetch_hint``;
``checkpoints/README.md`` lists the same sources.

Sources: madebyollin/taehv on GitHub publishes its ``.pth`` files in the repository root
(``taeltx2_3_wide.pth`` on its ``2026_03_11_taeltx23_wide`` branch); LightX2V publishes
its LightTAE files on Hugging Face (lightx2v/Autoencoders); the presets' reference VAEs
are the ``vae/`` folders of the video models' diffusers repositories on Hugging Face.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

WHERE = "checkpoints/README.md"
TAEHV_REPO = "https://github.com/madebyollin/taehv"
WIDE_BRANCH = "2026_03_11_taeltx23_wide"
TAEHV_MAIN = (
    "taehv",
    "taew2_1",
    "taew2_2",
    "taew2_2_super",
    "taehv1_5",
    "taehv1_5_super",
    "taecvx",
    "taeos1_3",
    "taeh3",
    "taeltx_2",
    "taeltx2_3",
)
# published TAE file name -> its download URL
GITHUB_FILES = {f"{name}.pth": f"{TAEHV_REPO}/raw/main/{name}.pth" for name in TAEHV_MAIN} | {
    "taeltx2_3_wide.pth": f"{TAEHV_REPO}/raw/{WIDE_BRANCH}/taeltx2_3_wide.pth"
}
# published TAE file name -> the Hugging Face repository holding it
HUB_FILES = {
    f"{name}.safetensors": "lightx2v/Autoencoders" for name in ("lighttaew2_1", "lighttaew2_2", "lighttaehy1_5")
}
# a preset's reference VAE folder (the name of its ref_vae_path) -> the diffusers repository whose vae/ it holds
HUB_VAES = {
    "CogVideoX-2b": "THUDM/CogVideoX-2b",
    "Wan2.2-TI2V-5B": "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
    "HunyuanVideo-1.5": "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
}


def fetch_command(path: str | os.PathLike, subfolder: str = "vae") -> str | None:
    """The shell command that puts the published file or reference VAE folder at ``path``
    (known by its name), else None. A reference VAE folder gets its ``subfolder`` only."""
    path = Path(path)
    name, target = path.name, shlex.quote(str(path))
    if name in GITHUB_FILES:
        return f"curl -L --fail --create-dirs -o {target} {GITHUB_FILES[name]}"
    if name in HUB_FILES:
        return f"hf download {HUB_FILES[name]} {name} --local-dir {shlex.quote(str(path.parent))}"
    if name in HUB_VAES:
        return f"hf download {HUB_VAES[name]} --include {shlex.quote(subfolder + '/*')} --local-dir {target}"
    return None


def fetch_hint(path: str | os.PathLike, subfolder: str = "vae") -> str:
    """What to add to a message about missing weights at ``path``: the command that fetches
    them when they are published, and where the sources are listed."""
    command = fetch_command(path, subfolder)
    return f"; fetch it with `{command}` ({WHERE})" if command else f"; where to get weights: {WHERE}"
