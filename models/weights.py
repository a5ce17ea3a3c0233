"""Reading and writing TAEHV weights in the published format.

Weights are plain fp32 state dicts with the published keys: ``.pth`` (loaded with
``weights_only=True``, never unpickling arbitrary objects) or ``.safetensors`` (with
metadata naming the variant). Loading is strict: one error lists every missing key,
unexpected key and shape mismatch, and names the variants the file would fit.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from taehv_train.base.atomic import TMP_PREFIX, atomic_write
from taehv_train.base.errors import (  # raised and imported from here
    CheckpointMismatchError,
    WeightsError,
    WeightsNotFoundError,
)

from .downloads import fetch_hint
from .variants import known_variants

logger = logging.getLogger(__name__)
FORMAT_NAME = "taehv"
WEIGHT_SUFFIXES = (".pth", ".pt", ".safetensors")


def _refuse_unfinished(path: Path) -> None:
    """A file or checkpoint folder still being written (``atomic.temporary_name``: renamed
    into place once complete, or left behind by an interrupted save) holds no usable weights
    yet: name the finished one to use instead."""
    written = next((p for p in (path, path.parent) if p.name.startswith(TMP_PREFIX)), None)
    if written is None:
        return
    final = written.with_name(written.name.removeprefix(TMP_PREFIX))
    when = (
        "it is there now"
        if final.exists()
        else "once it exists; if it never does, an interrupted save left this behind: use an earlier checkpoint"
    )
    raise WeightsError(
        f"{path} is still being written (training writes {written.name} and renames it to {final.name} once it "
        f"is complete): use {final / path.relative_to(written)} ({when})"
    )


def _check_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    _refuse_unfinished(path)
    if path.is_dir():
        raise WeightsError(f"{path} is a folder, not a file")
    if not path.is_file():
        raise WeightsNotFoundError(f"weight file {path} not found{fetch_hint(path)}")
    if path.suffix not in WEIGHT_SUFFIXES:
        raise WeightsError(f"{path}: expected one of {', '.join(WEIGHT_SUFFIXES)}")
    return path


def find_weights(path: str | os.PathLike) -> Path:
    """The weight file behind a path: the file itself, a training checkpoint or
    ``best_model`` folder (``weights.safetensors``) or a run folder (``final_model.safetensors``)."""
    path = Path(path)
    if path.is_dir():
        _refuse_unfinished(path)
        for name in ("weights.safetensors", "final_model.safetensors", "final_model.pth"):
            if (path / name).is_file():
                return path / name
        raise WeightsNotFoundError(
            f"{path} holds no weights.safetensors (checkpoint folder) or final_model.* (run folder)"
        )
    return _check_path(path)


def run_folder(weights: str | os.PathLike) -> Path | None:
    """The training run that wrote ``weights`` (its folder holds ``config.json``): next to
    ``final_model.*``, one level above ``best_model/``, two above ``checkpoints/checkpoint-N/``;
    None for a file from elsewhere."""
    weights = Path(weights)
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


def run_config_hint(weights: str | os.PathLike) -> dict | None:
    """The saved config of the run that wrote ``weights``, as JSON: a ``.pth`` carries no
    metadata, and its run says its variant and whether it had a reference VAE. None for a
    file from elsewhere, or a ``config.json`` that is not a JSON object (logged)."""
    run = run_folder(weights)
    if run is None:
        return None
    try:
        config = json.loads((run / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        logger.warning(
            "%s: not read (%s); %s is built from its own name and metadata", run / "config.json", err, weights
        )
        return None
    return config if isinstance(config, dict) else None


def _unreadable_safetensors(path: Path, err: SafetensorError) -> WeightsError:
    return WeightsError(f"{path} is not a readable safetensors file (damaged or truncated): {err}")


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """Our safetensors metadata (variant, patch size, ...); empty for ``.pth`` files."""
    path = _check_path(path)
    if path.suffix != ".safetensors":
        return {}
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except SafetensorError as err:
        raise _unreadable_safetensors(path, err) from err


def _refused_pickle(path: Path, err: pickle.UnpicklingError) -> WeightsError:
    """The error for a ``.pth`` that the safe unpickler refused. torch's own message advises
    loading without the safety check, which would run whatever code the file holds; only
    what the unpickler stopped at is kept from it."""
    found = re.search(r"Unsupported (global: GLOBAL \S+|operand \d+)", str(err))
    if found and found.group(1).startswith("global"):
        what = f"holds objects other than tensors ({found.group(1)})"
    else:  # an unknown opcode: garbage, or a pickle protocol feature plain weights never use
        what = f"is damaged or holds objects other than tensors{f' ({found.group(1)})' if found else ''}"
    return WeightsError(
        f"{path} {what} and was refused for safety: export plain weights (a state dict of tensors, "
        "e.g. torch.save(model.state_dict(), path)) or use .safetensors"
    )


def _load_pth(path: Path) -> object:
    """``torch.load`` restricted to tensors and plain containers, its failures as WeightsError."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise _refused_pickle(path, err) from None  # never chain torch's advice to drop the check
    except (EOFError, RuntimeError, KeyError, IndexError) as err:  # empty file, damaged zip archive, garbage bytes
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise WeightsError(f"{path} is not a readable PyTorch weight file (damaged or truncated): {detail}") from err


def read_tensors(path: str | os.PathLike) -> object:
    """What a ``.safetensors`` file (a dict of tensors) or a ``.pth``/``.pt`` file (tensors
    and plain containers only) holds, on the CPU; any failure a WeightsError."""
    path = _check_path(path)
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path), device="cpu")
        except SafetensorError as err:
            raise _unreadable_safetensors(path, err) from err
    return _load_pth(path)


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a weight file, on the CPU."""
    state_dict = read_tensors(path)
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise CheckpointMismatchError(
            f"{path} is not a plain state dict of tensors (a training checkpoint folder? "
            "export weights with training's final_model.pth / .safetensors)"
        )
    return state_dict


def shape_signature(state_dict: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state_dict.items()}


def describe_mismatch(expected: dict[str, tuple], found: dict[str, tuple]) -> list[str]:
    """Human-readable differences between two key -> shape maps (empty if they agree)."""
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    shapes = sorted(k for k in expected.keys() & found.keys() if expected[k] != found[k])
    lines = []
    if missing:
        lines.append(f"missing keys ({len(missing)}): {', '.join(missing[:12])}{' ...' if len(missing) > 12 else ''}")
    if unexpected:
        lines.append(
            f"unexpected keys ({len(unexpected)}): {', '.join(unexpected[:12])}{' ...' if len(unexpected) > 12 else ''}"
        )
    for k in shapes[:12]:
        lines.append(f"shape mismatch {k}: model {list(expected[k])}, file {list(found[k])}")
    if len(shapes) > 12:
        lines.append(f"... and {len(shapes) - 12} more shape mismatches")
    return lines


def fitting_variants(model_class: type[nn.Module], signature: dict[str, tuple[int, ...]]) -> list[str]:
    """Variants whose (full) architecture, built by ``model_class(variant=...)``, has
    exactly these keys and shapes."""
    fits = []
    with torch.device("meta"):
        for name in known_variants():
            if shape_signature(model_class(variant=name).state_dict()) == signature:
                fits.append(name)
    return fits


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of a floating-point ``tensor`` is finite. NaN and Inf carry into
    a sum, so a finite sum settles it in one fast pass; a sum that is not finite (such a
    value, or a sum beyond the dtype's range) is settled value by value."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def load_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Load a weight file into a TAEHV ``model`` strictly, or raise one error that says what
    differs. ``model.adapt_state_dict`` fits full weights into a preview decoder first.
    Weights holding NaN or Inf (a damaged file) are refused."""
    state_dict = read_state_dict(path)
    broken = [k for k, v in state_dict.items() if v.is_floating_point() and not all_finite(v)]
    if broken:
        raise WeightsError(
            f"{path}: {len(broken)} tensor(s) hold NaN or Inf (e.g. {broken[0]}): the file is damaged; "
            "use another copy or an earlier checkpoint"
        )
    found = model.adapt_state_dict(state_dict)
    expected = shape_signature(model.state_dict())
    problems = describe_mismatch(expected, shape_signature(found))
    if problems:
        fits = fitting_variants(type(model), shape_signature(read_state_dict(path)))
        hint = (
            f"the file fits variant(s) {', '.join(fits)}: pass variant='{fits[0]}' (or --variant {fits[0]})"
            if fits
            else "it fits no known variant; check patch_size / latent_channels / arch_variant"
        )
        raise CheckpointMismatchError(
            f"{path} does not fit the {model.variant} model (patch {model.patch_size}, "
            f"{model.latent_channels} latent channels, {model.arch_variant} decoder):\n  "
            + "\n  ".join(problems)
            + f"\n{hint}"
        )
    model.load_state_dict(found, strict=True)


def weights_metadata(model: nn.Module) -> dict[str, str]:
    """What a saved file needs to rebuild ``model`` without guessing from its name."""
    return {
        "format": FORMAT_NAME,
        "variant": model.variant,
        "patch_size": str(model.patch_size),
        "latent_channels": str(model.latent_channels),
        "arch_variant": model.arch_variant,
        "is_cogvideox": str(model.is_cogvideox).lower(),
        "encoder_time_downscale": json.dumps(model.encoder_time_downscale),
        "decoder_time_upscale": json.dumps(model.decoder_time_upscale),
        "h3_chunks": str(model.h3_chunks).lower(),
        "image_channels": str(model.image_channels),
        "causal": str(model.causal).lower(),
        "latent_space": model.latent_space or "unknown",
        **({"latent_transform": model.latent_transform.to_json()} if model.latent_transform is not None else {}),
        "activation": model.activation,
        "signed_pixels": str(model.signed_pixels).lower(),
        "frame_rule": (
            "T -> c = ceil(T/17) chunks of 17 frames -> 5c - 3 latents -> 17c - 12 frames"
            if model.h3_chunks
            else f"T -> ceil(T/{model.t_downscale}) latents -> {model.t_upscale}*latents"
            f" - {model.frames_to_trim} frames"
            + (" (no trim when the latent count is even)" if model.is_cogvideox else "")
        )
        + "; decoded frame i matches input frame i",
    }


def export_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Contiguous fp32 CPU copies of the weights (bf16 training must not leak into exports)."""
    return {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in model.state_dict().items()}


def save_weights(model: nn.Module, path: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Save a TAEHV's fp32 weights in the published key format (``.pth``) or with metadata
    (``.safetensors``), atomically.

    ``state_dict`` overrides the model's own weights (e.g. EMA or gathered ZeRO weights).
    """
    path = Path(path)
    if path.suffix not in (".pth", ".safetensors"):
        raise ValueError(f"{path}: save as .pth or .safetensors")
    tensors = (
        export_state_dict(model)
        if state_dict is None
        else {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state_dict.items()}
    )
    problems = describe_mismatch(shape_signature(model.state_dict()), shape_signature(tensors))
    if problems:
        raise CheckpointMismatchError("refusing to save weights that do not fit the model:\n  " + "\n  ".join(problems))
    if path.suffix == ".safetensors":
        return atomic_write(path, save(tensors, metadata=weights_metadata(model)))
    return atomic_write(path, lambda tmp: torch.save(tensors, tmp))
