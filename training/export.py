"""The export bundle: ``python -m training.export RUN_OR_WEIGHTS --out DIR``.

A training run writes the same bundle into ``export/`` at its end: published-name weight
files and a model card (what the model is, what it was trained on, how well it did).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save

from common.errors import UserError
from common.run_files import run_folder_of, verified_weights
from models.atomic import atomic_write
from models.vae_registry import video_model
from models.weights import export_state_dict, save_weights, weights_metadata
from training.state.checkpoints import list_checkpoints, read_trainer_state

BUNDLE_FOLDER = "export"  # where a training run writes its bundle


def training_length(run: Path, config: dict) -> str:
    """How long the run trained, from its newest complete checkpoint: steps of the step
    count, and under a time budget the seconds spent and the steps it planned."""
    checkpoints = list_checkpoints(run / "checkpoints")
    progress = read_trainer_state(checkpoints[-1])["progress"] if checkpoints else {}
    steps = progress.get("step", 0)
    if not config.get("max_train_time"):
        return f"{steps} of {config['max_train_steps']} steps"
    planned = progress.get("planned_steps") or config["max_train_steps"]
    return (
        f"{steps} steps in {progress.get('train_seconds', 0):.0f} s (max_train_time={config['max_train_time']}, "
        f"{planned} steps planned)"
    )


def _model_card(model, weights: Path, run: Path | None, files: list[str], command: str) -> str:
    """README.md of a bundle: what the model is, what it was trained on, how well it did."""
    metadata = weights_metadata(model)
    lines = [
        f"# {model.variant} (TAE)",
        "",
        f"A tiny video autoencoder in the latent space of {video_model(model.variant) or 'its reference VAE'}: "
        f"{model.latent_channels} latent channels, patch {model.patch_size}, {model.t_downscale}x in time.",
        "",
        f"- Frame rule: {metadata['frame_rule']}.",
        f"- Parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M.",
        f"- Weights: {weights}.",
    ]
    if run is not None:
        config = json.loads((run / "config.json").read_text())
        lines += [
            f"- Reference VAE: {config.get('ref_vae_path') or 'none (trained as a plain autoencoder)'}"
            + (f" ({config['ref_vae_class']})" if config.get("ref_vae_path") else ""),
            f"- Training data: {config.get('annotation_file') or config.get('data_root')}, "
            f"{config['n_frames']} frames at {config['height']}x{config['width']}, stride "
            f"{config['stride_min']}-{config['stride_max']}.",
            f"- Training: {training_length(run, config)}, batch "
            f"{config['train_batch_size']} x {config['gradient_accumulation_steps']} per process, learning rate "
            f"{config['learning_rate']}.",
            "- Training command(s), every start of the run: "
            + "; ".join(f"`{line}`" for line in (run / "command.txt").read_text().splitlines())
            if (run / "command.txt").is_file()
            else "- Training command: not recorded",
        ]
        history_file = run / "validation_history.json"
        history = json.loads(history_file.read_text()) if history_file.is_file() else []
        if history:
            keys = [k for k in history[-1] if k.startswith("val/")]
            lines += ["", "## Validation", "", "| step | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
            lines += ["| " + " | ".join([str(h["step"])] + [f"{h[k]:.4g}" for k in keys]) + " |" for h in history[-5:]]
    lines += ["", "## Files", ""] + [f"- `{name}`" for name in files] + ["", f"Made by {command}.", ""]
    return "\n".join(lines)


def write_bundle(
    weights: Path, out: Path, fp16: bool = False, command: str = "", overwrite: bool = False
) -> list[Path]:
    """The files a user takes away: ``<variant>.pth`` (published key format, fp32; loads in
    the published implementation by its name), ``<variant>.safetensors`` (the name ComfyUI
    and stable-diffusion.cpp look for; published keys plus our metadata), optionally
    ``<variant>_fp16.safetensors``, and a model card ``README.md``. Files already in ``out``
    are a UserError unless ``overwrite`` (a run rewrites its own ``export/``)."""
    from models.taehv import TAEHV

    model = TAEHV(weights)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file: name a folder for the bundle")
    names = [f"{model.variant}.pth", f"{model.variant}.safetensors", "README.md"]
    names += [f"{model.variant}_fp16.safetensors"] if fp16 else []
    if not overwrite and (there := [name for name in names if (out / name).exists()]):
        raise UserError(f"{out} already holds {', '.join(there)}: pass --force to replace them, or another --out")
    out.mkdir(parents=True, exist_ok=True)
    written = [
        save_weights(model, out / f"{model.variant}.pth"),
        save_weights(model, out / f"{model.variant}.safetensors"),
    ]
    if fp16:
        half = {k: v.half() for k, v in export_state_dict(model).items()}
        written.append(
            atomic_write(out / f"{model.variant}_fp16.safetensors", save(half, metadata=weights_metadata(model)))
        )
    card = _model_card(model, weights, run_folder_of(weights), [p.name for p in written], command)
    written.append(atomic_write(out / "README.md", card))
    return written


def main(argv: list[str] | None = None) -> None:
    import shlex
    import sys

    from common.flags import ArgumentParser

    parser = ArgumentParser(description="Write the export bundle of a training run or a weight file.")
    parser.add_argument("source", help="a run folder, a checkpoint or best_model folder, or a weight file")
    parser.add_argument("--out", required=True, help="folder to write the bundle into")
    parser.add_argument("--fp16", action="store_true", help="also write <variant>_fp16.safetensors")
    parser.add_argument("--force", action="store_true", help="replace the bundle's files when --out already holds them")
    args = parser.parse_args(argv)
    command = "`" + shlex.join(["python", "-m", "training.export", *(sys.argv[1:] if argv is None else argv)]) + "`"
    try:
        written = write_bundle(verified_weights(args.source), Path(args.out), args.fp16, command, overwrite=args.force)
    except OSError as err:  # read-only file system, no space, no permission: the user's to fix
        raise UserError(f"cannot write the bundle into {args.out}: {err.strerror or err}") from None
    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    from common.errors import exit_on_user_error

    exit_on_user_error(main)
