"""Config paths that name nothing, each with how to get it: part of the config check
(``training.preflight``) and of the resume decision (``training.state.run_config``)."""

from __future__ import annotations

from pathlib import Path

from taehv_train.common.config import PATH_KEYS, REPO_ROOT, SOURCE_KEYS, TrainConfig, resolve_path
from taehv_train.common.presets import preset_file
from taehv_train.common.shard_source import is_shard_source
from taehv_train.models.downloads import fetch_hint

DEMO_DATA = REPO_ROOT / "demo_output" / "data"  # the built-in clips of the demo and test presets


def missing_paths(config: TrainConfig) -> list[str]:
    """Path keys that name something that does not exist, each with how to get it: the
    command that makes the built-in demo clips, fetches published weights or a reference
    VAE (``models.downloads``), or the launch script's ``--data`` for clips of one's own."""
    found, hinted = [], False
    for key in PATH_KEYS[1:]:
        if key in SOURCE_KEYS and is_shard_source(getattr(config, key)):
            continue  # the shards are the data check's (training.data.loading.config_errors)
        if (value := getattr(config, key)) and not (path := resolve_path(value)).exists():
            demo = path.is_relative_to(DEMO_DATA) and not hinted
            how = made_by_preset(path) or how_to_get(key, path, config, demo)
            found.append(f"{key}: {path} does not exist{how}")
            hinted = hinted or demo
    return found


def how_to_get(key: str, path: Path, config: TrainConfig, demo: bool) -> str:
    """The end of ``missing_paths``' message for ``key``: how to get what it names."""
    if demo:
        demo_data = "python -m taehv_train.training.demo_data demo_output/data"
        return f": `make demo` makes the built-in clips there (or `{demo_data}` alone)"
    if key == "pretrained_model_path":
        return fetch_hint(path)
    if key == "ref_vae_path":
        return fetch_hint(path, config.ref_vae_subfolder)
    if key == "data_root":
        return ": to train on your own clips, add --data=DIR (a folder of videos) to ./train_taehv_h100.sh"
    return ""


def made_by_preset(path: Path) -> str:
    """For a missing export of a preset's run (``<output_dir>/<preset>/export/...``, the
    run folder named after the preset): the command that makes it."""
    run = path.parent.parent.name if path.parent.name == "export" else ""
    if not run or not preset_file(run).is_file():
        return ""
    return f": the end of the {run} run writes it (`./train_taehv_h100.sh N {run}`)"
