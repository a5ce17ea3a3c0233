"""The training presets, found by their file names: ``training/configs/taehv_config_<name>.py``
is the preset ``<name>`` (``taehv_config.py`` is the base they replace fields of). Config
loading, the launch script and messages ask here, so adding a preset is adding its file."""

from __future__ import annotations

from pathlib import Path

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "training" / "configs"
BASE = "taehv_config"  # the base recipe's file stem; a preset's is BASE_<name>
PREFIX = f"{BASE}_"


def preset_names() -> list[str]:
    """Every preset in the configs folder, sorted."""
    return sorted(path.stem.removeprefix(PREFIX) for path in CONFIGS_DIR.glob(f"{PREFIX}*.py"))


def preset_file(name: str) -> Path:
    """The config file of the preset ``name`` (which may not exist)."""
    return CONFIGS_DIR / f"{PREFIX}{name}.py"


def preset_of(path: Path) -> str | None:
    """The preset an absolute config path is, None for a file outside the configs folder."""
    if path.parent == CONFIGS_DIR and path.stem.startswith(PREFIX):
        return path.stem.removeprefix(PREFIX)
    return None
