"""Training configuration: one typed dataclass, Python config files, ``--key=value`` overrides.

A config file is a plain Python module that defines ``config`` (a ``TrainConfig``), usually
by ``replace``-ing the documented base in ``training/configs/taehv_config.py``. Overrides
on the command line are parsed to each field's type; an unknown key is an error that
names the closest valid key. Paths are made absolute here, once. This is the ground floor:
every numeric key's range is declared in ``common.config_ranges``, each component checks how its keys
fit together (``config_errors(config)`` next to its code), and ``training.preflight.check``
asks them all before heavy work starts. ``inference.py
--config`` reads the same files for its data, sizes and reference VAE.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import math
import runpy
import traceback
import typing
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from taehv_train.base.errors import UserError
from taehv_train.common.presets import BASE, preset_of
from taehv_train.common.shard_source import is_shard_source
from taehv_train.models.latent_spaces import AUTO_SPACE
from taehv_train.models.vae_classes import REF_VAE_CLASSES
from taehv_train.models.vae_registry import AUTO_CLASS, auto_variant, resolve_ref_vae_class, tae_space
from taehv_train.models.variants import VariantSpec, get_variant

REPO_ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger(__name__)
# dtype names users type (ref_vae_dtype, inference --dtype) -> torch dtypes
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def native_bf16() -> bool:
    """Whether this machine computes bf16 natively (a CUDA GPU, or a CPU with AVX512-BF16
    or AMX), where bf16 autocast trains faster than fp32 (presets choose their precision by it)."""
    cpu = torch.cpu
    return torch.cuda.is_available() or any(
        getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    )


@dataclass(frozen=True)
class TrainConfig:
    # -- run -------------------------------------------------------------------------
    output_dir: str = "output"  # runs go to output_dir/<run directory>
    run_name: str = ""  # fixed run directory name; empty: "<config name>_<timestamp>"
    config_file: str = ""  # set by load_config: the config file this run came from
    seed: int = 42

    # -- data ------------------------------------------------------------------------
    # Each of the three clip sources may instead name tar shards (local or s3://, https://, ...):
    # a glob, a brace pattern such as shards/{00000..00099}.tar, or several joined by "::" (docs/data.md)
    data_root: str = ""  # folder the annotation paths are relative to (or a folder of videos)
    annotation_file: str = ""  # users' JSON format; empty: scan data_root for videos
    val_annotation_file: str = ""  # held-out clips; empty: no validation
    shard_shuffle_buffer: int = 1000  # clips from tar shards: the shuffle buffer's size (clip numbers, no memory)
    shard_read_attempts: int = 5  # a read from a shard that fails transiently (a dropped connection) is retried
    shard_retry_wait_s: float = 15.0  # ... with doubling waits from 0.5 s, at most this long in all per read
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
    prefetch_factor: int = 2  # batches each loader worker prepares ahead
    prefetch_batches: int = 2  # batches a thread keeps received (on CUDA: already on the GPU) for the step
    # seconds the step waits for one batch before this process's loader counts as failed (a stalled
    # loader worker or storage: the run saves its last step and stops, exit 2); 0: no bound
    batch_timeout: float = 600.0
    persistent_workers: bool = True
    frame_cache_mb: int = 0  # per loader process: videos kept decoded and downscaled in memory (0: off; docs/data.md)

    # -- model -----------------------------------------------------------------------
    variant: str = "taecvx"  # a TAE variant (models/variants.py), or "auto": the reference VAE's own
    pretrained_model_path: str = ""  # published or our weights; empty: train from scratch
    train_encoder: bool = True  # False: decoder-only fine-tuning; the encoder (and so the latent space) stays as loaded
    decoder_bias_init: float = 0.5  # final decoder conv bias when training from scratch
    compile: str = "auto"  # torch.compile the blocks (TAEHV.compile): auto (on CUDA), true or false
    compile_backend: str = (
        "inductor"  # torch.compile backend when compile=true ("aot_eager": tracing only, for debugging)
    )

    # -- reference VAE (empty path: plain autoencoder training) ------------------------
    ref_vae_path: str = ""  # diffusers model folder, e.g. a local copy of CogVideoX-2b
    ref_vae_class: str = "auto"  # auto: from the folder's config.json; or one of models.vae_classes.REF_VAE_CLASSES
    ref_vae_subfolder: str = "vae"
    ref_vae_dtype: str = "bf16"  # "fp32", "bf16" or "fp16"
    ref_latent_sample: bool = True  # latent_dist.sample() (recipe); False: the mode
    # which latents the TAE works on: raw, scaled, normalised or normalised_scaled (models/latent_spaces.py);
    # auto: the variant's published space, else its pipeline's (docs/reference_vaes.md, "Which latents go in")
    latent_space: str = "auto"
    latent_cache_dir: str = (
        ""  # latents precomputed by `python -m taehv_train.training.build_latent_cache`; empty: online
    )
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
    max_train_steps: int = 100_000  # optimizer steps; 0 with max_train_time: no step limit, the budget decides
    # wall-clock budget ("8h", "45m", "1h30m", "600s"), start-up and final save included: planned as a step count
    # and corrected as the run goes (training/loop/time_budget.py); typed without --max_train_steps, the budget
    # alone is the run's length (with_budget)
    max_train_time: str = ""
    validations_per_budget: int = 10  # under max_train_time: validations spread over the run; 0: validation_every
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
    # trackers the scalars go to, comma-separated: tensorboard, wandb, mlflow, comet_ml, aim, clearml, dvclive,
    # swanlab, trackio, or all (the installed ones); the others are optional extras (training/loop/trackers.py)
    report_to: str = "tensorboard"
    log_every: int = 50  # lowered so a run of known length logs its loss ~40 times, unless typed (monitoring.py)
    validation_every: int = 1000
    num_validation_samples: int = 20
    validation_batch_size: int = 2
    # reconstruction strips in TensorBoard, written at validation steps that are multiples of this (and the last);
    # 0 disables
    image_log_every: int = 1000
    checkpointing_steps: int = 1000  # also saved at the end and when SIGTERM/SIGINT arrives
    checkpoints_total_limit: int = 3  # newest complete checkpoints kept (best_model/ is separate)
    resume_from_checkpoint: str = ""  # "latest", a checkpoint name or a path
    auto_resume: bool = False  # continue the newest complete checkpoint of this run if any, else start fresh
    allow_data_change: bool = False  # a resume may go on with clips other than those its run started with

    # -- best model, early stopping and numerical faults -----------------------------
    best_metric: str = "val/psnr"  # what best_model/ and early stopping follow (direction known per metric)
    early_stopping_patience: int = 0  # validations without improvement before stopping; 0: never
    early_stopping_min_delta: float = 0.0  # smallest change of best_metric that counts as improvement
    max_consecutive_skipped_steps: int = 20  # non-finite or out-of-memory steps in a row before the run stops

    # -- debugging -------------------------------------------------------------------
    detect_anomaly: bool = False
    profile_steps: int = 0  # >0: write a torch profiler trace of that many steps
    fault_injection: str = ""  # tests only: e.g. "nan_loss@3:1,sigterm@5" (training/loop/resilience.py FaultPlan)

    def __post_init__(self) -> None:
        if isinstance(self.compile, bool):  # compile=True/False (a config file, a run's config.json) means true/false
            object.__setattr__(self, "compile", str(self.compile).lower())

    @property
    def validation_size(self) -> tuple[int, int]:
        """(height, width) of the held-out clips: val_height x val_width, else the training size."""
        return self.val_height or self.height, self.val_width or self.width

    def replace(self, **changes) -> TrainConfig:
        """A copy with ``changes``; an unknown key is a UserError that names the closest one
        (config files call this: ``load_config`` adds the file and line)."""
        for key in changes:
            if key not in _TYPES:
                raise UserError(unknown_key_message(key))
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
        raise UserError(f"--{key}={text!r}: expected a {kind.__name__}") from None


def unknown_key_message(key: str) -> str:
    close = difflib.get_close_matches(key, [f.name for f in fields(TrainConfig)], n=1)
    return f"unknown config key {key!r}" + (f"; did you mean {close[0]!r}?" if close else "")


def _split_override(item: str) -> tuple[str, str | None]:
    """``--key=value`` (or ``key=value``, kebab-case too) as (key, value); value None without "="."""
    body = item.removeprefix("--")
    key, equals, value = body.partition("=")
    return key.replace("-", "_"), value if equals else None


def given_keys(overrides: list[str]) -> set[str]:
    """The config keys that ``--key=value`` overrides set."""
    return {_split_override(item)[0] for item in overrides}


def apply_overrides(config: TrainConfig, overrides: list[str]) -> TrainConfig:
    """Apply ``--key=value`` (or ``key=value``) strings, typed by the dataclass fields."""
    changes = {}
    for item in overrides:
        key, value = _split_override(item)
        if value is None:
            raise UserError(f"override {item!r} must look like --key=value")
        if key not in _TYPES:
            raise UserError(unknown_key_message(key))
        changes[key] = _parse_value(key, value)
    return replace(config, **changes)


def load_config(path: str | Path, overrides: list[str] = ()) -> TrainConfig:
    """Run a Python config file and take its ``config``, or read a run's ``config.json`` (the
    file, or its run folder: ``config_from_json``); then apply overrides. A file that is
    neither is a UserError naming both kinds."""
    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if not path.is_file():
        raise UserError(f"config file {path} not found")
    if path.suffix == ".json":
        return resolve_paths(with_overrides(config_from_json(path), list(overrides)))
    stamp = path.stat()
    config = _run_config_file(path, path.resolve(), stamp.st_mtime_ns, stamp.st_size)
    return with_auto_variant(resolve_paths(with_overrides(replace(config, config_file=str(path)), list(overrides))))


@functools.cache
def _run_config_file(path: Path, resolved: Path, mtime_ns: int, size: int) -> TrainConfig:
    """The ``config`` the Python config file ``path`` (``resolved``) defines, run once per
    process (and again once the file changed: ``mtime_ns``, ``size``): a config file is
    Python code, which a start reads in more than one place (a resume checks it against the
    run's)."""
    try:
        namespace = runpy.run_path(str(path))
    except SyntaxError as err:
        if path.suffix != ".py":  # a log, a video, a weight file: no config at all
            raise UserError(f"{path}: {UNREADABLE_CONFIG}") from err
        raise UserError(f"{path}:{err.lineno}: syntax error: {err.msg}") from None
    except UserError as err:  # e.g. config.replace(lerning_rate=...): where in the file
        lines = [
            frame.lineno
            for frame in traceback.extract_tb(err.__traceback__)
            if Path(frame.filename).resolve() == resolved
        ]
        raise UserError(f"{path}:{lines[-1]}: {err}" if lines else str(err)) from None
    except Exception as err:  # not Python that runs here (a log, a video, a config of another tool)
        raise UserError(f"{path}: {UNREADABLE_CONFIG} ({type(err).__name__}: {err})") from err
    config = namespace.get("config")
    if not isinstance(config, TrainConfig):
        raise UserError(f"{path} must define `config = TrainConfig(...)` (got {type(config).__name__})")
    return config


ANNOTATION_KEYS = ("annotation_file", "val_annotation_file")


def with_overrides(base: TrainConfig, overrides: list[str]) -> TrainConfig:
    """``apply_overrides``; a ``max_train_time`` given alone is the run's length
    (``with_budget``); a ``data_root`` naming tar shards replaces the base's training
    annotation file (the shards are the clips); and a ``data_root`` given alone takes the base's annotation files
    with it: when no annotation key is given and the base's annotation files lie under the
    base's own ``data_root``, they list the base's clips, not the new folder's, so they are
    cleared and the new folder is scanned, without a validation set (the config check's note
    says so and names make_annotations)."""
    given = given_keys(overrides)
    config = with_budget(apply_overrides(base, overrides), given)
    if "data_root" in given and "annotation_file" not in given and is_shard_source(config.data_root):
        config = replace(config, annotation_file="")  # the shards are the training clips
    if "data_root" not in given or given & set(ANNOTATION_KEYS):
        return config
    if not all(isinstance(v, str) and v for v in (base.data_root, config.data_root)):
        return config
    base_root = resolve_path(base.data_root)
    annotations = [resolve_path(v) for key in ANNOTATION_KEYS if isinstance(v := getattr(base, key), str) and v]
    if resolve_path(config.data_root) == base_root or not annotations:
        return config
    if not all(path.is_relative_to(base_root) for path in annotations):
        return config
    return replace(config, **dict.fromkeys(ANNOTATION_KEYS, ""))


def with_budget(config: TrainConfig, given: set[str]) -> TrainConfig:
    """A ``max_train_time`` typed without ``max_train_steps`` is the run's length: the step
    count of the config file (or of a run being resumed) does not cut it short, so it
    becomes 0 (no step limit); a ``max_train_steps`` typed beside it stays a cap."""
    if config.max_train_time and "max_train_time" in given and "max_train_steps" not in given:
        return replace(config, max_train_steps=0)
    return config


UNREADABLE_CONFIG = "cannot read it as a config: give a Python config that defines `config`, or a run's config.json"


def config_from_json(path: Path) -> TrainConfig:
    """The config a run saved in its ``config.json`` (``describe``): what it trained with,
    already resolved, so the tools that take a run folder use the run's data, sizes and
    variant. Keys this version does not know are left out with a note (a run of another
    version); a file that is not a JSON object of config values is a UserError."""
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: {UNREADABLE_CONFIG} ({err})") from err
    if not isinstance(values, dict):
        raise UserError(f"{path}: {UNREADABLE_CONFIG} (a JSON {type(values).__name__}, not an object)")
    unknown = sorted(set(values) - set(_TYPES))
    if unknown:
        logger.info("%s: left out the keys this version does not know: %s", path, ", ".join(unknown))
    known = {  # JSON writes 1.0 as 1.0, but a hand-written 0 for a float key is meant as 0.0
        key: float(value) if _TYPES[key] is float and type(value) is int else value
        for key, value in values.items()
        if key in _TYPES
    }
    config = TrainConfig(**known)
    if problems := type_problems(config):
        raise UserError(f"{path}: {problems[0]}")
    return config


def with_auto_variant(config: TrainConfig) -> TrainConfig:
    """``ref_vae_class="auto"`` becomes the class the reference VAE's config.json names,
    ``variant="auto"`` its own TAE variant, and ``latent_space="auto"`` the space that variant
    lives in next to that VAE (its own without one); each left as it is when that cannot be
    told, for ``check`` to explain. Runs, caches and checkpoints then record what was resolved."""
    config = _with_auto_class_and_variant(config)
    class_known = not config.ref_vae_path or config.ref_vae_class in REF_VAE_CLASSES
    if config.latent_space != AUTO_SPACE or config.variant == "auto" or not class_known:
        return config
    return replace(
        config, latent_space=tae_space(config.variant, config.ref_vae_class if config.ref_vae_path else None)
    )


def _with_auto_class_and_variant(config: TrainConfig) -> TrainConfig:
    if not config.ref_vae_path:
        return config
    folder = Path(config.ref_vae_path) / config.ref_vae_subfolder
    if config.ref_vae_class == AUTO_CLASS:
        try:
            config = replace(config, ref_vae_class=resolve_ref_vae_class(AUTO_CLASS, folder))
        except ValueError:  # the config check says why
            return config
    if config.variant != "auto":
        return config
    found = auto_variant(config.ref_vae_class, folder)
    return config if found is None else replace(config, variant=found)


def run_prefix(config: TrainConfig) -> str:
    """Name stem of this config's run directories ("h100" for taehv_config_h100.py)."""
    if config.run_name:
        return config.run_name
    stem = Path(config.config_file).stem if config.config_file else BASE
    return stem.removeprefix(BASE).lstrip("_") or "base"


def config_file_label(config_file: str) -> str:
    """How messages name the config a run came from: "the test preset" for
    training/configs/taehv_config_test.py, else "the config file <path>"."""
    preset = preset_of(resolve_path(config_file))
    return f"the {preset} preset" if preset is not None else f"the config file {config_file}"


def same_config_file(recorded: str, current: str) -> bool:
    """Whether two recorded ``config_file`` values name the same config: the same file name,
    and the same file where both are absolute paths (a relative one was relative to the
    directory training started in, which is not recorded). A run that recorded none is
    given the benefit of the doubt."""
    if not recorded or not current:
        return True
    first, second = Path(recorded), Path(current)
    if first.name != second.name:
        return False
    return not (first.is_absolute() and second.is_absolute()) or first.resolve() == second.resolve()


def changed_from_file(config: TrainConfig, keys: tuple[str, ...]) -> list[str]:
    """Those of ``keys`` whose value differs from what the config file itself says, that
    is, set on the command line; none for a config that did not come from a file."""
    if not config.config_file or not Path(config.config_file).is_file():
        return []
    own = load_config(config.config_file)
    return [key for key in keys if getattr(own, key) != getattr(config, key)]


def resolve_path(path: str) -> Path:
    """Config paths are relative to the repository root, wherever training is launched."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def resolve_source(value: str) -> str:
    """A clip source made absolute: a path as ``resolve_path``; tar shards part by part
    ("::"), a URL as it is."""
    if not is_shard_source(value):
        return str(resolve_path(value))
    return "::".join(part if "://" in part else str(resolve_path(part)) for part in value.split("::"))


# the keys that name files or folders: load_config makes them absolute, once
PATH_KEYS = (
    "output_dir",
    "data_root",
    "annotation_file",
    "val_annotation_file",
    "pretrained_model_path",
    "ref_vae_path",
    "latent_cache_dir",
)


SOURCE_KEYS = ("data_root", "annotation_file", "val_annotation_file")  # clips: a path, or tar shards


def resolve_paths(config: TrainConfig) -> TrainConfig:
    """Every path key made absolute (relative ones are relative to the repository root), so
    the rest of the code uses them as they are."""
    return replace(
        config,
        **{
            key: resolve_source(value) if key in SOURCE_KEYS else str(resolve_path(value))
            for key in PATH_KEYS
            if isinstance(value := getattr(config, key), str) and value
        },
    )  # others: type_problems


# -- the config's own problems (each component checks its keys: training/preflight.py) ----


def type_problems(config: TrainConfig) -> list[str]:
    """Values of the wrong type, and numbers that are not finite."""
    problems = []
    for name, value in config.to_dict().items():
        if not isinstance(value, _TYPES[name]):
            problems.append(f"{name}={value!r} should be a {_TYPES[name].__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{name}={value!r} must be a finite number")
    return problems


def spec_of(config: TrainConfig) -> VariantSpec:
    """The config's TAE variant (UserError for an unknown name)."""
    try:
        return get_variant(config.variant)
    except ValueError as err:
        raise UserError(str(err)) from None


def invalid_config(problems: list[str]) -> UserError:
    """One line for one problem, one line each for several."""
    return UserError(
        f"invalid config: {problems[0]}" if len(problems) == 1 else "invalid config:\n  " + "\n  ".join(problems)
    )


def describe(config: TrainConfig) -> str:
    return json.dumps(config.to_dict(), indent=2)
