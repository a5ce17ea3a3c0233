"""The export bundle: ``python -m taehv_train.training.export RUN_OR_WEIGHTS --out DIR``.

A training run writes the same bundle into ``export/`` at its end: published-name weight
files and a model card (what the model is, what it was trained on, how well it did).
"""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors.torch import save

from taehv_train.base.atomic import atomic_write
from taehv_train.base.errors import UserError
from taehv_train.common.config import REPO_ROOT
from taehv_train.common.run_files import (
    WEIGHT_CHOICES,
    RunWeights,
    run_folder_of,
    run_weights,
    validation_history,
    weights_in_run,
)
from taehv_train.models.latent_spaces import OWN, RAW, LatentTransform
from taehv_train.models.vae_registry import video_model
from taehv_train.models.weights import WeightsError, all_finite, export_state_dict, save_weights, weights_metadata
from taehv_train.training.ecosystem import (
    Reading,
    comfyui_dtype,
    comfyui_preview,
    comfyui_reading,
    export_stem,
    previews_taking,
    published_loads,
    readings,
)
from taehv_train.training.state.run_folders import list_checkpoints, read_trainer_state

logger = logging.getLogger(__name__)
BUNDLE_FOLDER = "export"  # where a training run writes its bundle
FP16_MAX = float(torch.finfo(torch.float16).max)
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16"}


def training_length(run: Path, config: dict) -> str:
    """How long the run trained, from its newest complete checkpoint: steps of the step
    count, and under a time budget the seconds spent and the steps it planned."""
    checkpoints = list_checkpoints(run / "checkpoints")
    progress = read_trainer_state(checkpoints[-1])["progress"] if checkpoints else {}
    steps = progress.get("step", 0)
    if not config.get("max_train_time"):
        return f"{steps} of {config['max_train_steps']} steps"
    planned = progress.get("planned_steps")
    return f"{steps} steps in {progress.get('train_seconds', 0):.0f} s (max_train_time={config['max_train_time']}" + (
        f", {planned} steps planned)" if planned else ", spent before its step count was planned)"
    )


def _space_lines(model) -> list[str]:
    """The model card's description of the latents the model works on."""
    if model.latent_space == OWN:
        return [
            f"A tiny video autoencoder with a latent space of its own (trained without a reference VAE): its "
            f"latents are not {video_model(model.variant) or 'any video model'}'s, so no diffusion model's latents "
            f"decode with it. {model.latent_channels} latent channels, patch {model.patch_size}, "
            f"{model.t_downscale}x in time.",
        ]
    space = model.latent_transform or (LatentTransform(model.latent_space) if model.latent_space else None)
    return [
        f"A tiny video autoencoder in the latent space of {video_model(model.variant) or 'its reference VAE'}: "
        f"{model.latent_channels} latent channels, patch {model.patch_size}, {model.t_downscale}x in time.",
        "",
        f"- Latent space: {space.describe() if space else 'not recorded'}"
        + (" (docs/reference_vaes.md, 'Which latents go in')." if space else "."),
    ]


def _loading_lines(model, files: dict[str, torch.dtype]) -> list[str]:
    """How to load the bundle: this package, the published ``taehv.py``, diffusers pipelines,
    and how ComfyUI and LightX2V take each ``.safetensors`` file, with what to do where their
    rules take it for another model (``training.ecosystem``)."""
    pth, safetensors = list(files)[:2]  # <stem>.pth, <stem>.safetensors (write_bundle)
    own = model.latent_space == OWN
    lines = [
        "",
        "## Loading it",
        "",
        f'- This package (taehv-train): `TAEHV("{safetensors}")` from `taehv_train.models.taehv`; `{pth}` loads the '
        "same way (its name gives the variant).",
        f'- The published `taehv.py` (madebyollin/taehv): `TAEHV(checkpoint_path="{pth}")`, which builds the '
        "architecture from the file name."
        if published_loads(model.variant, model.activation)
        else f"- The published `taehv.py` (madebyollin/taehv) cannot build it ({model.variant}, {model.activation}): "
        "use this package.",
        "- diffusers pipelines: not as a pipeline's VAE: its latents are its own, no diffusion model's."
        if own
        else f'- diffusers pipelines: `pipe.vae = TAEVideoVAE.from_file("{safetensors}", like=pipe.vae)` from '
        "`taehv_train.models.diffusers_vae` (it converts between the pipeline's latents and the TAE's).",
    ]
    if own:
        return lines + [
            "- ComfyUI and LightX2V hand a TAE a diffusion model's latents: neither applies to a TAE with latents "
            "of its own."
        ]
    for name, dtype in files.items():
        if not name.endswith(".safetensors"):
            continue
        for reading in readings(name, model.variant, model.latent_channels, model.patch_size, dtype):
            lines.append(
                f"- {reading.tool} takes `{name}` as {reading.how}, {reading.activation}, decoding "
                f"{reading.space} latents: {_verdict(model, reading)}."
            )
    return lines + _preview_lines(model, files)


def _verdict(model, reading: Reading) -> str:
    """Whether a tool's reading of a file is this TAE in its space, and what to do if not."""
    if reading.activation != model.activation:
        return (
            f"not this network (it has {model.activation}): decode with the diffusers wrapper "
            "(TAEVideoVAE.from_file) or this package's TAEHV instead"
        )
    if reading.space != model.latent_space:
        return (
            f"the right network, handed the wrong latents (it decodes {model.latent_space} ones): convert "
            "them first, or decode with the diffusers wrapper (TAEVideoVAE.from_file), which does"
        )
    return "the right model"


def _preview_lines(model, files: dict[str, torch.dtype]) -> list[str]:
    """What ComfyUI's live preview does with the bundle's files in ``models/vae_approx``
    (``training.ecosystem.comfyui_preview``): the file it takes for the TAE's own model and
    what that file decodes, or why none is taken; and other models' previews that would take
    a file by its name."""
    preview = comfyui_preview(list(files), model.variant)
    video = video_model(model.variant) or "its video model"
    if preview is None:
        lines = [
            "- ComfyUI's live preview: of ComfyUI's video latent formats only HunyuanVideo's (1.5), Wan's and "
            f"MiniMax H3's name a TAE to preview with (`taesd_decoder_name`): none previews {video} with this file."
        ]
    elif not preview.candidates:
        lines = [
            f"- ComfyUI's live preview of {video} ({preview.model.latent_format}) loads "
            f"`models/vae_approx/{preview.model.preview_name}*` and hands it {preview.model.latents} latents: "
            f"none of these files is named so, and this TAE decodes {model.latent_space} ones: no core ComfyUI "
            "preview route"
            + (
                f" (trained with `--latent_space=raw` it is exported as `{export_stem(model.variant, RAW)}`, the name "
                "that preview takes)."
                if export_stem(model.variant, RAW).startswith(preview.model.preview_name)
                else "."
            )
        ]
    else:
        outputs = 3 * model.patch_size**2
        read = {
            name: comfyui_reading(model.latent_channels, outputs, files[name], model.variant)
            for name in preview.candidates
        }
        verdicts = {name: _verdict(model, reading) for name, reading in read.items()}
        taken = preview.candidates[0]
        reading, verdict = read[taken], verdicts[taken]
        lines = [
            f"- ComfyUI's live preview of {video} ({preview.model.latent_format}) takes `{taken}`, the first file "
            f"in `models/vae_approx` named `{preview.model.preview_name}*`, as {reading.how}, and hands it the first "
            f"latent frame of the sampler's denoised estimate through `{preview.model.latent_format}.process_out`: "
            f"{preview.model.latents} latents, as VAEDecode does, then the file's own format: {reading.space} "
            f"latents: {verdict}."
        ]
        right = [name for name, said in verdicts.items() if said == "the right model"]
        if verdict != "the right model" and right:
            lines.append(f"  Put `{right[0]}` in `models/vae_approx` without the other files: the right model there.")
    for other, names in previews_taking(list(files), model.variant).items():
        lines.append(
            f"- {', '.join(f'`{n}`' for n in names)} also start with `{other.preview_name}`: in `models/vae_approx` "
            f"next to a {other.latent_format} model, ComfyUI's preview of that model takes it for that model's TAE."
        )
    return lines


def portable(command: str) -> str:
    """A command line without local paths, as a model card shows it: a path inside the
    repository relative to it, any other absolute path by its name."""

    def short(word: str) -> str:
        path = Path(word).expanduser()
        if not path.is_absolute():
            return word
        return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else path.name

    words = []
    for word in shlex.split(command):
        key, eq, value = word.partition("=")
        words.append(f"{key}={short(value)}" if word.startswith("--") and eq else short(word))
    return shlex.join(words)


def _validation_lines(run: Path, exported_step: int | None) -> list[str]:
    """Every validation of the run, the one the bundle holds marked."""
    history = validation_history(run)
    if not history:
        return ["", "## Validation", "", "The run did not validate: the bundle holds its final weights."]
    keys = [k for k in history[-1] if k.startswith("val/")]
    lines = ["", "## Validation", "", "| step | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for entry in history:
        step = f"**{entry['step']}** (exported)" if entry["step"] == exported_step else str(entry["step"])
        values = [f"{entry[k]:.4g}" if k in entry else "-" for k in keys]
        lines.append("| " + " | ".join([step, *values]) + " |")
    return lines


def _model_card(model, chosen: RunWeights, files: dict[str, torch.dtype], command: str) -> str:
    """README.md of a bundle: what the model is, which latents it works on, what it was
    trained on, how well it did, and how to load it here and in other tools. No local paths:
    files by their names in the bundle, runs and folders by their names."""
    metadata = weights_metadata(model)
    run = run_folder_of(chosen.path)
    lines = [
        f"# {model.variant} (TAE)",
        "",
        *_space_lines(model),
        f"- Frame rule: {metadata['frame_rule']}.",
        f"- Parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M.",
        f"- Weights: {chosen.line or chosen.path.name}.",
    ]
    if run is not None:
        config = json.loads((run / "config.json").read_text())
        ref_vae = config.get("ref_vae_path")
        lines += [
            f"- Reference VAE: {Path(ref_vae).name} ({config['ref_vae_class']})"
            if ref_vae
            else "- Reference VAE: none (trained as a plain autoencoder)",
            f"- Training data: {Path(config.get('data_root') or config.get('annotation_file')).name}, "
            f"{config['n_frames']} frames at {config['height']}x{config['width']}, stride "
            f"{config['stride_min']}-{config['stride_max']}.",
            f"- Training: {training_length(run, config)}, batch "
            f"{config['train_batch_size']} x {config['gradient_accumulation_steps']} per process, learning rate "
            f"{config['learning_rate']}.",
            "- Training command(s), every start of the run: "
            + "; ".join(f"`{portable(line)}`" for line in (run / "command.txt").read_text().splitlines())
            if (run / "command.txt").is_file()
            else "- Training command: not recorded",
        ]
        lines += _validation_lines(run, chosen.step)
    lines += _loading_lines(model, files)
    lines += ["", "## Files", ""] + [f"- `{name}` ({DTYPE_NAMES[dtype]})" for name, dtype in files.items()]
    lines += ["", f"Made by {command}.", ""]
    return "\n".join(lines)


def half_precision(model, advice: str) -> dict[str, torch.Tensor]:
    """The weights in fp16; UserError ending in ``advice`` when one does not fit (beyond
    fp16's 65504, or not finite), instead of writing infinite weights."""
    weights = export_state_dict(model)
    over = [k for k, v in weights.items() if not all_finite(v) or float(v.abs().max()) > FP16_MAX]
    if over:
        largest = max(float(weights[k].abs().max()) for k in over)
        raise UserError(
            f"{len(over)} tensor(s) do not fit fp16 (e.g. {over[0]}; largest magnitude {largest:.3g}, fp16 holds "
            f"up to {FP16_MAX:g}): {advice}"
        )
    return {k: v.half() for k, v in weights.items()}


def write_bundle(
    weights: Path | RunWeights,
    out: Path,
    fp16: bool = False,
    command: str = "",
    overwrite: bool = False,
    tell: Callable[[str], None] = logger.info,
) -> list[Path]:
    """The files a user takes away, named and typed so that other tools take them as this
    TAE in its latent space (``training.ecosystem``): ``<stem>.pth`` (published key format,
    fp32; loads in the published implementation by its name), ``<stem>.safetensors`` (the
    name ComfyUI looks for; published keys plus our metadata; fp16 where ComfyUI's rule needs
    it), optionally ``<stem>_fp16.safetensors``, and a model card ``README.md``. The stem is
    the variant, or LightX2V's name for a Wan TAE on raw latents. Files already in ``out``
    are a UserError unless ``overwrite`` (a run rewrites its own ``export/``). ``weights``
    chosen among a run's (``run_weights``) say which they are in the card. ``tell`` gets
    the card's line on ComfyUI's live preview: whether the bundle has a route there."""
    from taehv_train.models.taehv import TAEHV

    chosen = weights if isinstance(weights, RunWeights) else weights_in_run(weights)
    model = TAEHV(chosen.path)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file: name a folder for the bundle")
    stem = export_stem(model.variant, model.latent_space)
    comfyui = comfyui_dtype(model.latent_channels, model.latent_space, model.activation)
    files = {f"{stem}.pth": torch.float32, f"{stem}.safetensors": comfyui}
    files |= {f"{stem}_fp16.safetensors": torch.float16} if fp16 else {}
    if not overwrite and (there := [name for name in [*files, "README.md"] if (out / name).exists()]):
        raise UserError(f"{out} already holds {', '.join(there)}: pass --force to replace them, or another --out")
    half = None
    if torch.float16 in files.values():  # asked for with --fp16, or the dtype ComfyUI's rule needs
        half = half_precision(
            model,
            "export without --fp16"
            if comfyui == torch.float32
            else f"ComfyUI takes {stem}.safetensors as this TAE only in fp16, so these weights cannot be exported",
        )
    out.mkdir(parents=True, exist_ok=True)
    written = [save_weights(model, out / f"{stem}.pth")]
    for name, dtype in list(files.items())[1:]:
        written.append(
            save_weights(model, out / name)
            if dtype == torch.float32
            else atomic_write(out / name, save(half, metadata=weights_metadata(model)))
        )
    card = _model_card(model, chosen, files, command)
    written.append(atomic_write(out / "README.md", card))
    if model.latent_space != OWN:
        tell(_preview_lines(model, files)[0].removeprefix("- "))
    return written


def main(argv: list[str] | None = None) -> None:
    import sys

    from taehv_train.base.flags import ArgumentParser

    parser = ArgumentParser(description="Write the export bundle of a training run or a weight file.")
    parser.add_argument("source", help="a run folder, a checkpoint or best_model folder, or a weight file")
    parser.add_argument(
        "--weights",
        choices=WEIGHT_CHOICES,
        default=None,
        help="which weights of a run folder: best (the default: its best validation, or its final weights when it "
        "did not validate) or final (its final model; its newest checkpoint when unfinished)",
    )
    parser.add_argument("--out", required=True, help="folder to write the bundle into")
    parser.add_argument("--fp16", action="store_true", help="also write <stem>_fp16.safetensors")
    parser.add_argument("--force", action="store_true", help="replace the bundle's files when --out already holds them")
    args = parser.parse_args(argv)
    if not args.out.strip():  # Path("") is the current folder
        raise UserError("--out is empty: name the folder to write the bundle into")
    typed = ["python", "-m", "taehv_train.training.export", *(sys.argv[1:] if argv is None else argv)]
    command = f"`{portable(shlex.join(typed))}`"
    with ExitStack() as held:  # the folder of the weights, held from choosing them to the bundle's end
        chosen = run_weights(args.source, args.weights, held)
        if chosen.told:
            print(f"weights: {chosen.told}")
        try:
            written = write_bundle(chosen, Path(args.out), args.fp16, command, overwrite=args.force, tell=print)
        except WeightsError:  # the source's problem, not the output folder's
            raise
        except OSError as err:  # read-only file system, no space, no permission: the user's to fix
            raise UserError(f"cannot write the bundle into {args.out}: {err.strerror or err}") from None
    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    from taehv_train.base.errors import exit_on_user_error
    from taehv_train.base.process_exit import exit_without_teardown

    with exit_without_teardown():
        exit_on_user_error(main)
