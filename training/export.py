"""Exporting the trained weights: full fp32 state dicts in the published key format.

What gets exported is the EMA weights when they are kept, else the optimizer's fp32 master
weights (DeepSpeed bf16/fp16 keeps the module itself in low precision), under every
distributed mode: ``weights.safetensors`` in each checkpoint, ``best_model/`` and the run's
``final_model.pth`` / ``final_model.safetensors``. At the end, a run also writes its export
bundle (``write_bundle``: published-name files and a model card) into ``export/``; the
same comes from ``python -m training.export RUN_OR_WEIGHTS --out DIR``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save
from accelerate import Accelerator
from accelerate.utils import DistributedType
from diffusers.training_utils import EMAModel

from models.atomic import atomic_write
from models.checkpoint import export_state_dict, find_weights, save_weights, weights_metadata
from training.checkpointing import list_checkpoints, read_trainer_state, write_atomically


def fp32_weights(accelerator: Accelerator, model: torch.nn.Module, ema: EMAModel | None,
                 frozen: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Full fp32 weights in the published key format: the EMA or master weights of what
    trains, ``frozen`` (fp32, as loaded) for what does not. Under DeepSpeed every rank must
    call this (the master weights are sharded)."""
    net = accelerator.unwrap_model(model)
    state = {k: v.detach().float() for k, v in net.state_dict().items()}
    trainable = [(name, param) for name, param in net.named_parameters() if param.requires_grad]
    if ema is not None:
        state.update(zip([name for name, _ in trainable], ema.shadow_params))
    elif accelerator.distributed_type == DistributedType.DEEPSPEED:
        from deepspeed.utils import safe_get_full_fp32_param

        for name, param in trainable:
            full = safe_get_full_fp32_param(param)
            if full is None and param.dtype != torch.float32:
                raise RuntimeError(f"cannot recover fp32 master weights of {name} from DeepSpeed")
            state[name] = (param if full is None else full).detach().float()
    state.update(frozen or {})
    return state


def export_weights(accelerator: Accelerator, model: torch.nn.Module, ema: EMAModel | None, directory: Path,
                   stem: str, suffixes: tuple[str, ...] = (".pth", ".safetensors"),
                   frozen: dict[str, torch.Tensor] | None = None) -> None:
    """Write ``directory/<stem><suffix>`` (call on every rank; the main process writes)."""
    state = fp32_weights(accelerator, model, ema, frozen)
    if accelerator.is_main_process:
        for suffix in suffixes:
            save_weights(accelerator.unwrap_model(model), directory / f"{stem}{suffix}", state)


def export_best_model(accelerator: Accelerator, model: torch.nn.Module, ema: EMAModel | None, run_dir: Path,
                      info: dict, frozen: dict[str, torch.Tensor] | None = None) -> None:
    """Atomically replace ``best_model/`` (weights + ``model_info.json``); every rank calls it."""
    def write(tmp: Path) -> None:
        export_weights(accelerator, model, ema, tmp, "weights", frozen=frozen)
        if accelerator.is_main_process:
            (tmp / "model_info.json").write_text(json.dumps(info, indent=1))

    write_atomically(accelerator, run_dir / "best_model", write, {"step": info["step"]})


# ----------------------------------------------------------------------------------------
# The export bundle: python -m training.export RUN_OR_WEIGHTS --out DIR
# ----------------------------------------------------------------------------------------

BUNDLE_FOLDER = "export"  # where a training run writes its bundle


def run_folder_of(weights: Path) -> Path | None:
    """The training run that wrote ``weights`` (its folder holds ``config.json``): next to
    ``final_model.*``, one level above ``best_model/``, two above ``checkpoints/checkpoint-N/``;
    None for a file from elsewhere."""
    folder = weights.parent
    if weights.name.startswith("final_model"):
        run = folder
    elif folder.name == "best_model":
        run = folder.parent
    elif folder.parent.name == "checkpoints":
        run = folder.parent.parent
    else:
        return None
    return run if (run / "config.json").is_file() else None


def trained_steps(run: Path) -> int:
    """Optimizer steps of the run's newest complete checkpoint (0 without one)."""
    checkpoints = list_checkpoints(run / "checkpoints")
    return read_trainer_state(checkpoints[-1])["progress"]["step"] if checkpoints else 0


def _model_card(model, weights: Path, run: Path | None, files: list[str], command: str) -> str:
    """README.md of a bundle: what the model is, what it was trained on, how well it did."""
    metadata = weights_metadata(model)
    lines = [f"# {model.variant} (TAE)", "",
             f"A tiny video autoencoder in the latent space of {model.spec.reference or 'its reference VAE'}: "
             f"{model.latent_channels} latent channels, patch {model.patch_size}, {model.t_downscale}x in time.", "",
             f"- Frame rule: {metadata['frame_rule']}.",
             f"- Parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M.",
             f"- Weights: {weights}."]
    if run is not None:
        config = json.loads((run / "config.json").read_text())
        lines += [f"- Reference VAE: {config.get('ref_vae_path') or 'none (trained as a plain autoencoder)'}"
                  + (f" ({config['ref_vae_class']})" if config.get("ref_vae_path") else ""),
                  f"- Training data: {config.get('annotation_file') or config.get('data_root')}, "
                  f"{config['n_frames']} frames at {config['height']}x{config['width']}, stride "
                  f"{config['stride_min']}-{config['stride_max']}.",
                  f"- Training: {trained_steps(run)} of {config['max_train_steps']} steps, batch "
                  f"{config['train_batch_size']} x {config['gradient_accumulation_steps']} per process, learning rate "
                  f"{config['learning_rate']}.",
                  "- Training command(s), every start of the run: " + "; ".join(
                      f"`{line}`" for line in (run / "command.txt").read_text().splitlines())
                  if (run / "command.txt").is_file() else "- Training command: not recorded"]
        history_file = run / "validation_history.json"
        history = json.loads(history_file.read_text()) if history_file.is_file() else []
        if history:
            keys = [k for k in history[-1] if k.startswith("val/")]
            lines += ["", "## Validation", "", "| step | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
            lines += ["| " + " | ".join([str(h["step"])] + [f"{h[k]:.4g}" for k in keys]) + " |" for h in history[-5:]]
    lines += ["", "## Files", ""] + [f"- `{name}`" for name in files] + ["", f"Made by {command}.", ""]
    return "\n".join(lines)


def write_bundle(weights: Path, out: Path, fp16: bool = False, command: str = "") -> list[Path]:
    """The files a user takes away: ``<variant>.pth`` (published key format, fp32; loads in
    the published implementation by its name), ``<variant>.safetensors`` (the name ComfyUI
    and stable-diffusion.cpp look for; published keys plus our metadata), optionally
    ``<variant>_fp16.safetensors``, and a model card ``README.md``."""
    from models.taehv import TAEHV

    model = TAEHV(weights)
    out.mkdir(parents=True, exist_ok=True)
    written = [save_weights(model, out / f"{model.variant}.pth"), save_weights(model, out / f"{model.variant}.safetensors")]
    if fp16:
        half = {k: v.half() for k, v in export_state_dict(model).items()}
        written.append(atomic_write(out / f"{model.variant}_fp16.safetensors", save(half, metadata=weights_metadata(model))))
    card = _model_card(model, weights, run_folder_of(weights), [p.name for p in written], command)
    written.append(atomic_write(out / "README.md", card))
    return written


def main(argv: list[str] | None = None) -> None:
    import argparse
    import shlex
    import sys

    parser = argparse.ArgumentParser(description="Write the export bundle of a training run or a weight file.")
    parser.add_argument("source", help="a run folder, a checkpoint or best_model folder, or a weight file")
    parser.add_argument("--out", required=True, help="folder to write the bundle into")
    parser.add_argument("--fp16", action="store_true", help="also write <variant>_fp16.safetensors")
    args = parser.parse_args(argv)
    command = "`" + shlex.join(["python", "-m", "training.export", *(sys.argv[1:] if argv is None else argv)]) + "`"
    for path in write_bundle(find_weights(args.source), Path(args.out), args.fp16, command):
        print(f"wrote {path}")


if __name__ == "__main__":
    from training.errors import exit_on_config_error

    exit_on_config_error(main)
