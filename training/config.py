"""Training configuration: one typed dataclass, Python config files, ``--key=value`` overrides.

A config file is a plain Python module that defines ``config`` (a ``TrainConfig``), usually
by ``replace``-ing the documented base in ``training/configs/taehv_config.py``. Overrides
on the command line are parsed to each field's type; an unknown key is an error that
names the closest valid key. ``check`` validates everything that can be checked before
heavy work starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import runpy
import sys
import typing
from dataclasses import dataclass, fields, replace
from pathlib import Path

from models.frames import exact_frame_counts, plan_frames
from models.variants import get_variant

REPO_ROOT = Path(__file__).resolve().parents[1]
MIXED_PRECISION = ("no", "fp16", "bf16")
LR_SCHEDULERS = ("constant", "constant_with_warmup", "cosine", "linear")
REF_VAE_CLASSES = ("cogvideox", "hunyuan", "wan")


class ConfigError(ValueError):
    """A configuration problem, with a message that says what to change."""


@dataclass(frozen=True)
class TrainConfig:
    # -- run -------------------------------------------------------------------------
    output_dir: str = "output"  # runs go to output_dir/<run directory>
    run_name: str = ""  # fixed run directory name; empty: "<config name>_<timestamp>"
    config_file: str = ""  # set by load_config: the config file this run came from
    seed: int = 42

    # -- data ------------------------------------------------------------------------
    data_root: str = ""  # folder the annotation paths are relative to (or a folder of videos)
    annotation_file: str = ""  # users' JSON format; empty: scan data_root for videos
    val_annotation_file: str = ""  # held-out clips; empty: no validation
    n_frames: int = 17  # frames per clip; see check() for the valid values
    height: int = 480
    width: int = 720
    stride_min: int = 1  # temporal stride drawn from [stride_min, stride_max]
    stride_max: int = 3
    crop_scale_min: float = 0.6  # random crop area fraction before the resize
    crop_scale_max: float = 1.0
    hflip: bool = True
    short_clip_policy: str = "lower_stride"  # or "skip"
    max_failure_fraction: float = 0.05  # start-up probe: more bad files than this is an error
    dataloader_num_workers: int = 4
    prefetch_factor: int = 2
    persistent_workers: bool = True

    # -- model -----------------------------------------------------------------------
    variant: str = "taecvx"
    pretrained_model_path: str = ""  # published or our weights; empty: train from scratch
    decoder_bias_init: float = 0.5  # final decoder conv bias when training from scratch

    # -- reference VAE (empty path: plain autoencoder training) ------------------------
    ref_vae_path: str = ""  # diffusers model folder, e.g. a local copy of CogVideoX-2b
    ref_vae_class: str = "cogvideox"
    ref_vae_subfolder: str = "vae"
    ref_vae_dtype: str = "bf16"  # "fp32", "bf16" or "fp16"
    ref_latent_sample: bool = True  # latent_dist.sample() (recipe); False: the mode

    # -- losses ----------------------------------------------------------------------
    encoder_loss_weight: float = 1.0  # MSE(encode(x), z_ref)
    decoder_loss_weight: float = 1.0  # MSE(decode(z_ref), x)
    reconstruction_loss_weight: float = 1.0  # MSE(decode(encode(x)), x)
    lpips_loss_weight: float = 0.0  # on decode(encode(x)); needs the optional lpips extra

    # -- optimisation ----------------------------------------------------------------
    train_batch_size: int = 2  # per process
    gradient_accumulation_steps: int = 1  # the only source: accelerate YAMLs must not set it
    max_train_steps: int = 100_000  # optimizer steps
    learning_rate: float = 1e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0  # applied in every mode, DeepSpeed included; 0 disables
    lr_scheduler: str = "cosine"
    lr_warmup_steps: int = 2000
    mixed_precision: str = "bf16"
    use_ema: bool = True
    ema_decay: float = 0.999

    # -- monitoring and checkpoints --------------------------------------------------
    log_every: int = 50
    validation_every: int = 1000
    num_validation_samples: int = 20
    validation_batch_size: int = 2
    image_log_every: int = 1000  # reconstruction strips in TensorBoard; 0 disables
    checkpointing_steps: int = 1000
    checkpoints_total_limit: int = 3
    resume_from_checkpoint: str = ""  # "latest", a checkpoint name or a path

    # -- debugging -------------------------------------------------------------------
    detect_anomaly: bool = False
    profile_steps: int = 0  # >0: write a torch profiler trace of that many steps

    def replace(self, **changes) -> "TrainConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_TYPES = typing.get_type_hints(TrainConfig)


def _parse_value(key: str, text: str):
    kind = _TYPES[key]
    try:
        if kind is bool:
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return lowered in ("true", "1", "yes")
        return kind(text)
    except ValueError:
        raise ConfigError(f"--{key}={text!r}: expected a {kind.__name__}") from None


def unknown_key_message(key: str) -> str:
    close = difflib.get_close_matches(key, [f.name for f in fields(TrainConfig)], n=1)
    return f"unknown config key {key!r}" + (f"; did you mean {close[0]!r}?" if close else "")


def apply_overrides(config: TrainConfig, overrides: list[str]) -> TrainConfig:
    """Apply ``--key=value`` (or ``key=value``) strings, typed by the dataclass fields."""
    changes = {}
    for item in overrides:
        body = item[2:] if item.startswith("--") else item
        if "=" not in body:
            raise ConfigError(f"override {item!r} must look like --key=value")
        key, value = body.split("=", 1)
        key = key.replace("-", "_")
        if key not in _TYPES:
            raise ConfigError(unknown_key_message(key))
        changes[key] = _parse_value(key, value)
    return replace(config, **changes)


def load_config(path: str | Path, overrides: list[str] = ()) -> TrainConfig:
    """Run a Python config file, take its ``config`` and apply overrides."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    namespace = runpy.run_path(str(path))
    config = namespace.get("config")
    if not isinstance(config, TrainConfig):
        raise ConfigError(f"{path} must define `config = TrainConfig(...)` (got {type(config).__name__})")
    return apply_overrides(replace(config, config_file=str(path)), list(overrides))


def run_prefix(config: TrainConfig) -> str:
    """Name stem of this config's run directories ("h100" for taehv_config_h100.py)."""
    if config.run_name:
        return config.run_name
    stem = Path(config.config_file).stem if config.config_file else "taehv_config"
    return stem.removeprefix("taehv_config").lstrip("_") or "base"


def resolve_path(path: str) -> Path:
    """Config paths are relative to the repository root, wherever training is launched."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def check(config: TrainConfig) -> list[str]:
    """Validate a config before any heavy work. Raises ConfigError listing every problem;
    returns informational notes (e.g. frames the reconstruction loss does not cover)."""
    problems, notes = [], []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    for name, value in config.to_dict().items():
        need(isinstance(value, _TYPES[name]), f"{name}={value!r} should be a {_TYPES[name].__name__}")
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))

    try:
        spec = get_variant(config.variant)
    except (ValueError, NotImplementedError) as err:
        raise ConfigError(str(err)) from None
    multiple = 8 * spec.patch_size
    need(config.height % multiple == 0 and config.width % multiple == 0,
         f"height and width must be multiples of {multiple} (8 * patch_size of {spec.name}), got {config.height}x{config.width}")
    need(config.n_frames >= 1, "n_frames must be >= 1")
    need(1 <= config.stride_min <= config.stride_max, "need 1 <= stride_min <= stride_max")
    need(0 < config.crop_scale_min <= config.crop_scale_max <= 1, "need 0 < crop_scale_min <= crop_scale_max <= 1")
    need(config.short_clip_policy in ("lower_stride", "skip"), "short_clip_policy must be 'lower_stride' or 'skip'")
    need(config.mixed_precision in MIXED_PRECISION, f"mixed_precision must be one of {MIXED_PRECISION}")
    need(config.lr_scheduler in LR_SCHEDULERS, f"lr_scheduler must be one of {LR_SCHEDULERS}")
    need(config.ref_vae_class in REF_VAE_CLASSES, f"ref_vae_class must be one of {REF_VAE_CLASSES}")
    need(config.ref_vae_dtype in ("fp32", "bf16", "fp16"), "ref_vae_dtype must be fp32, bf16 or fp16")
    for name in ("train_batch_size", "gradient_accumulation_steps", "max_train_steps", "log_every",
                 "validation_every", "validation_batch_size", "checkpointing_steps", "checkpoints_total_limit"):
        need(getattr(config, name) >= 1, f"{name} must be >= 1")
    for name in ("encoder_loss_weight", "decoder_loss_weight", "reconstruction_loss_weight", "lpips_loss_weight",
                 "max_grad_norm", "weight_decay", "lr_warmup_steps", "dataloader_num_workers", "image_log_every",
                 "profile_steps", "num_validation_samples"):
        need(getattr(config, name) >= 0, f"{name} must be >= 0")
    need(config.learning_rate > 0, "learning_rate must be > 0")
    need(0 < config.ema_decay < 1, "ema_decay must be in (0, 1)")

    plan = plan_frames(config.n_frames, 4, 4, spec.is_cogvideox)
    exact = exact_frame_counts(64, 4, 4, spec.is_cogvideox)
    if config.ref_vae_path:
        valid = [t for t in exact if (t - 1) % 4 == 0 and t > 1]
        need(config.n_frames in valid,
             f"n_frames={config.n_frames} does not work with a reference VAE and {spec.name}: the reference VAE "
             f"encodes 4k+1 frames to k+1 latents and the decoder must return exactly the input frames "
             f"(here {plan.decoded_frames} from {plan.latent_frames} latents). Valid: {', '.join(map(str, valid))}")
        need(config.encoder_loss_weight + config.decoder_loss_weight + config.reconstruction_loss_weight > 0,
             "all loss weights are 0")
    else:
        need(config.reconstruction_loss_weight > 0,
             "without a reference VAE only the reconstruction loss trains the model: set reconstruction_loss_weight > 0")
        if not plan.exact:
            notes.append(f"n_frames={config.n_frames}: {spec.name} decodes {plan.decoded_frames} frames, so the "
                         f"reconstruction loss covers input frames 0..{plan.aligned_frames - 1}; exact values: "
                         f"{', '.join(map(str, exact[:8]))}, ...")
        notes.append("no reference VAE: plain autoencoder training (encoder/decoder distillation losses off)")

    for name in ("pretrained_model_path", "ref_vae_path", "annotation_file", "val_annotation_file", "data_root"):
        value = getattr(config, name)
        need(not value or resolve_path(value).exists(), f"{name}: {resolve_path(value)} does not exist")
    need(bool(config.data_root or config.annotation_file), "set data_root (a folder of videos) or annotation_file")
    if config.lpips_loss_weight > 0:
        from training.metrics import lpips_unavailable_reason

        reason = lpips_unavailable_reason()
        need(reason is None, f"lpips_loss_weight > 0 but LPIPS is unusable: {reason}")
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
    return notes


def exit_on_config_error(main: typing.Callable[[], object]) -> None:
    """Run a CLI entry point; a configuration problem exits with status 2 and its message,
    without a traceback (it is the user's to fix, not a crash)."""
    try:
        main()
    except ConfigError as err:
        print(f"configuration error: {err}", file=sys.stderr)
        sys.exit(2)


def describe(config: TrainConfig) -> str:
    return json.dumps(config.to_dict(), indent=2)

