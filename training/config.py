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
import math
import runpy
import typing
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from models.frames import H3_CHUNK_FRAMES, exact_frame_counts, group_sizes
from models.variants import VariantSpec, get_variant
from training.best_model import METRIC_DIRECTIONS
from training.errors import ConfigError
from training.metrics import lpips_unavailable_reason
from training.resilience import FaultPlan
from training.teachers import TEACHERS, auto_variant, teacher_problems

REPO_ROOT = Path(__file__).resolve().parents[1]
MIXED_PRECISION = ("no", "fp16", "bf16")
LR_SCHEDULERS = ("constant", "constant_with_warmup", "cosine", "linear")
# ref_vae_class -> the diffusers class that loads it (training, the latent cache and inference)
REF_VAE_CLASSES = {name: teacher.diffusers_class for name, teacher in TEACHERS.items()}
# dtype names users type (ref_vae_dtype, inference --dtype) -> torch dtypes
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
    height: int = 480  # training size (of the crops the clips are resized to)
    width: int = 720
    val_height: int = 0  # held-out clips' size (validation, inference --config); 0: height x width.
    val_width: int = 0  # Lets a run train on small crops and validate whole frames at full size.
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
    variant: str = "taecvx"  # a TAE variant (models/variants.py), or "auto": the reference VAE's own
    pretrained_model_path: str = ""  # published or our weights; empty: train from scratch
    train_encoder: bool = True  # False: decoder-only fine-tuning; the encoder (and so the latent space) stays as loaded
    decoder_bias_init: float = 0.5  # final decoder conv bias when training from scratch
    compile: bool = False  # torch.compile the blocks (TAEHV.compile); the first steps and validations pay compilation
    compile_backend: str = "inductor"  # torch.compile backend when compile=true ("aot_eager": tracing only, for debugging)

    # -- reference VAE (empty path: plain autoencoder training) ------------------------
    ref_vae_path: str = ""  # diffusers model folder, e.g. a local copy of CogVideoX-2b
    ref_vae_class: str = "cogvideox"  # one of training.teachers.TEACHERS (docs/teachers.md)
    ref_vae_subfolder: str = "vae"
    ref_vae_dtype: str = "bf16"  # "fp32", "bf16" or "fp16"
    ref_latent_sample: bool = True  # latent_dist.sample() (recipe); False: the mode
    latent_cache_dir: str = ""  # reference latents precomputed by `python -m training.cache_latents`; empty: online
    latent_cache_epochs: int = 1  # epochs of random draws (clip window, crop, flip) the cache holds

    # -- Seraena adversarial targets (models/seraena.py) --------------------------------
    use_seraena: bool = False
    seraena_loss_weight: float = 1.0  # MSE(decoded, corrected target)
    n_seraena_frames: int = 1  # decoded frames per discriminator sample (stacked on channels)
    seraena_buffer_size: int = 16384  # replay buffer size in samples (memory is logged at start-up)
    seraena_learning_rate: float = 3e-4

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
    image_log_every: int = 1000  # reconstruction strips in TensorBoard, written at validation steps that are multiples of this (and the last); 0 disables
    checkpointing_steps: int = 1000  # also saved at the end and when SIGTERM/SIGINT arrives
    checkpoints_total_limit: int = 3  # newest complete checkpoints kept (best_model/ is separate)
    resume_from_checkpoint: str = ""  # "latest", a checkpoint name or a path
    auto_resume: bool = False  # continue the newest complete checkpoint of this run if any, else start fresh

    # -- best model, early stopping and numerical faults -----------------------------
    best_metric: str = "val/psnr"  # what best_model/ and early stopping follow (direction known per metric)
    early_stopping_patience: int = 0  # validations without improvement before stopping; 0: never
    early_stopping_min_delta: float = 0.0  # smallest change of best_metric that counts as improvement
    max_consecutive_skipped_steps: int = 20  # non-finite or out-of-memory steps in a row before the run stops

    # -- debugging -------------------------------------------------------------------
    detect_anomaly: bool = False
    profile_steps: int = 0  # >0: write a torch profiler trace of that many steps
    fault_injection: str = ""  # tests only: e.g. "nan_loss@3:1,sigterm@5" (training/resilience.py FaultPlan)

    @property
    def validation_size(self) -> tuple[int, int]:
        """(height, width) of the held-out clips: val_height x val_width, else the training size."""
        return self.val_height or self.height, self.val_width or self.width

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
    return with_auto_variant(apply_overrides(replace(config, config_file=str(path)), list(overrides)))


def with_auto_variant(config: TrainConfig) -> TrainConfig:
    """``variant="auto"`` becomes the reference VAE's own TAE variant (read from its
    config.json); left as it is when that cannot be told, for ``check`` to explain."""
    if config.variant != "auto" or not config.ref_vae_path:
        return config
    found = auto_variant(config.ref_vae_class, resolve_path(config.ref_vae_path) / config.ref_vae_subfolder)
    return config if found is None else replace(config, variant=found)


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
        need(not isinstance(value, float) or math.isfinite(value), f"{name}={value!r} must be a finite number")
    if problems:
        raise invalid_config(problems)

    if config.variant == "auto":
        vae_problems = teacher_problems(config.ref_vae_class, resolve_path(config.ref_vae_path) / config.ref_vae_subfolder,
                                        "auto") if config.ref_vae_path and config.ref_vae_class in TEACHERS else []
        raise invalid_config(vae_problems or ["variant=auto takes the reference VAE's own TAE variant: set ref_vae_path "
                                              "(and ref_vae_class) to its diffusers folder, or name the variant"])
    try:
        spec = get_variant(config.variant)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    multiple = 8 * spec.patch_size
    need(config.height > 0 and config.width > 0, f"height and width must be positive, got {config.height}x{config.width}")
    need(config.height % multiple == 0 and config.width % multiple == 0,
         f"height and width must be multiples of {multiple} (8 * patch_size of {spec.name}), got {config.height}x{config.width}")
    need(config.val_height >= 0 and config.val_width >= 0 and (config.val_height == 0) == (config.val_width == 0),
         f"set both val_height and val_width (positive), or neither, got {config.val_height}x{config.val_width}")
    need(config.val_height % multiple == 0 and config.val_width % multiple == 0,
         f"val_height and val_width must be multiples of {multiple} (8 * patch_size of {spec.name}), "
         f"got {config.val_height}x{config.val_width}")
    need(config.n_frames >= 1, "n_frames must be >= 1")
    need(1 <= config.stride_min <= config.stride_max, "need 1 <= stride_min <= stride_max")
    need(0 < config.crop_scale_min <= config.crop_scale_max <= 1, "need 0 < crop_scale_min <= crop_scale_max <= 1")
    need(config.short_clip_policy in ("lower_stride", "skip"), "short_clip_policy must be 'lower_stride' or 'skip'")
    need(config.mixed_precision in MIXED_PRECISION, f"mixed_precision must be one of {MIXED_PRECISION}")
    need(config.lr_scheduler in LR_SCHEDULERS, f"lr_scheduler must be one of {LR_SCHEDULERS}")
    need(config.ref_vae_class in REF_VAE_CLASSES, f"ref_vae_class must be one of {', '.join(REF_VAE_CLASSES)}")
    need(config.ref_vae_dtype in DTYPES, f"ref_vae_dtype must be one of {', '.join(DTYPES)}")
    for name in ("train_batch_size", "gradient_accumulation_steps", "max_train_steps", "log_every",
                 "validation_every", "validation_batch_size", "checkpointing_steps", "checkpoints_total_limit",
                 "max_consecutive_skipped_steps", "n_seraena_frames"):
        need(getattr(config, name) >= 1, f"{name} must be >= 1")
    for name in ("encoder_loss_weight", "decoder_loss_weight", "reconstruction_loss_weight", "lpips_loss_weight",
                 "seraena_loss_weight",
                 "max_grad_norm", "weight_decay", "lr_warmup_steps", "dataloader_num_workers", "image_log_every",
                 "profile_steps", "num_validation_samples", "early_stopping_patience", "early_stopping_min_delta"):
        need(getattr(config, name) >= 0, f"{name} must be >= 0")
    need(config.learning_rate > 0, "learning_rate must be > 0")
    if config.compile:
        known = compile_backends()
        need(config.compile_backend in known, f"compile_backend={config.compile_backend!r} is not a torch.compile "
             f"backend; known: {', '.join(name for name in known if 'TESTING' not in name)}")
    need(0 < config.ema_decay < 1, "ema_decay must be in (0, 1)")

    plan = spec.plan(config.n_frames)
    # for the messages; the rule is plan.exact, no limit
    exact = exact_frame_counts(64, spec.t_downscale, spec.t_upscale, spec.is_cogvideox, spec.h3_chunks)
    if config.ref_vae_path:
        valid = [t for t in exact if reference_vae_frames(t, spec)][:8]
        need(plan.exact and reference_vae_frames(config.n_frames, spec),
             f"n_frames={config.n_frames} does not work with a reference VAE and {spec.name}: the reference VAE "
             f"{reference_vae_rule(spec)} and the decoder must return exactly the input frames "
             f"(here {plan.decoded_frames} from {plan.latent_frames} latents). Valid: {', '.join(map(str, valid))}, ...")
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

    if config.use_seraena:
        sizes = group_sizes(plan.decoded_frames)
        even = [g for g in sizes if config.train_batch_size * plan.decoded_frames // g % 2 == 0]
        need(config.n_seraena_frames in sizes,
             f"n_seraena_frames={config.n_seraena_frames} does not divide the {plan.decoded_frames} decoded frames of "
             f"n_frames={config.n_frames} ({spec.name}); frames would be dropped. Valid: {', '.join(map(str, sizes))}")
        need(config.n_seraena_frames not in sizes or config.n_seraena_frames in even,
             f"Seraena splits each batch into halves, so train_batch_size x decoded frames / n_seraena_frames "
             f"({config.train_batch_size} x {plan.decoded_frames} / {config.n_seraena_frames}) must be even: use an "
             f"even train_batch_size" + (f" or n_seraena_frames in {even}" if even else ""))
        need(config.seraena_buffer_size >= 1, "seraena_buffer_size must be >= 1")
        need(config.seraena_learning_rate > 0, "seraena_learning_rate must be > 0")
    need(config.train_encoder or bool(config.pretrained_model_path),
         "train_encoder=false keeps the encoder as loaded: set pretrained_model_path (e.g. stage 1's export)")
    if not config.train_encoder and config.ref_vae_path and config.encoder_loss_weight > 0:
        notes.append("train_encoder=false: the encoder loss is logged but trains nothing (the encoder is frozen)")
    need(config.latent_cache_epochs >= 1, "latent_cache_epochs must be >= 1")
    need(not config.latent_cache_dir or bool(config.ref_vae_path),
         "latent_cache_dir holds reference latents: set ref_vae_path to the VAE the cache was made with")

    for name in ("pretrained_model_path", "ref_vae_path", "annotation_file", "val_annotation_file", "data_root",
                 "latent_cache_dir"):
        value = getattr(config, name)
        need(not value or resolve_path(value).exists(), f"{name}: {resolve_path(value)} does not exist")
    if config.ref_vae_path and resolve_path(config.ref_vae_path).exists() and config.ref_vae_class in TEACHERS:
        problems.extend(reference_vae_problems(config))
    need(bool(config.data_root or config.annotation_file), "set data_root (a folder of videos) or annotation_file")
    need(config.best_metric in METRIC_DIRECTIONS,
         f"best_metric={config.best_metric!r}: expected one of {', '.join(METRIC_DIRECTIONS)}")
    need(config.best_metric != "val/psnr_from_reference_latents" or bool(config.ref_vae_path),
         "best_metric=val/psnr_from_reference_latents needs a reference VAE (ref_vae_path)")
    need(config.early_stopping_patience == 0 or bool(config.val_annotation_file and config.num_validation_samples),
         "early_stopping_patience > 0 needs validation: set val_annotation_file and num_validation_samples > 0")
    try:
        FaultPlan.parse(config.fault_injection)
    except ConfigError as err:
        problems.append(str(err))
    if config.lpips_loss_weight > 0 or config.best_metric == "val/lpips":
        reason = lpips_unavailable_reason()
        need(reason is None, f"lpips_loss_weight > 0 or best_metric=val/lpips, but LPIPS is unusable: {reason}")
    if problems:
        raise invalid_config(problems)
    return notes


def compile_backends() -> list[str]:
    """The ``torch.compile`` backends this torch knows, its debugging ones (``aot_eager``,
    ``eager``) included."""
    import torch._dynamo  # seconds to import: only when compile=true is checked

    return torch._dynamo.list_backends(exclude_tags=())


def invalid_config(problems: list[str]) -> ConfigError:
    """One line for one problem, one line each for several."""
    return ConfigError(f"invalid config: {problems[0]}" if len(problems) == 1 else
                       "invalid config:\n  " + "\n  ".join(problems))


def reference_vae_problems(config: TrainConfig) -> list[str]:
    """What makes ``ref_vae_path`` unfit to teach ``config.variant``, read from the model
    folder's ``config.json`` alone: checked before launch, and before the weights are loaded."""
    return teacher_problems(config.ref_vae_class, resolve_path(config.ref_vae_path) / config.ref_vae_subfolder,
                            config.variant)


def reference_vae_frames(n_frames: int, spec: VariantSpec) -> bool:
    """Whether the reference VAE of ``spec`` takes ``n_frames`` frames: ``t_downscale * k + 1``
    (k >= 1) encode to k+1 latents (4k+1 for most, 8k+1 for LTX); MiniMax H3 pads clips to
    17-frame chunks and decodes only more than 17 frames (docs/h3_alignment.md)."""
    if spec.h3_chunks:
        return n_frames > H3_CHUNK_FRAMES
    return n_frames > 1 and (n_frames - 1) % spec.t_downscale == 0


def reference_vae_rule(spec: VariantSpec) -> str:
    if spec.h3_chunks:
        return f"pads clips to {H3_CHUNK_FRAMES}-frame chunks and decodes only clips of more than {H3_CHUNK_FRAMES} frames"
    return f"encodes {spec.t_downscale}k+1 frames to k+1 latents"


def describe(config: TrainConfig) -> str:
    return json.dumps(config.to_dict(), indent=2)

