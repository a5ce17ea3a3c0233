"""The launch script's command line (``./train_taehv_h100.sh NUM_GPUS CONFIG_TYPE ...``): its
usage text, and the arguments turned into the config file, the training overrides and the
command as typed, which training prints back in its resume command.

Paths the user types (``--data``, a custom config, ``--resume PATH`` and the ``--*_path``,
``--*_file``, ``--*_root``, ``--*_dir`` overrides) are taken from the folder the script was
run from when they exist there, else as they are (relative to the repository, where the
launch runs and the presets' own relative paths lead).
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from taehv_train.common.presets import preset_file, preset_names

# the script's own options; anything else is a --key=value override of the config
OPTIONS = ("--resume", "--data", "--debug", "--profile", "--help")
DEBUG = [
    "--debug",
    "--detect_anomaly=true",
    "--log_every=1",
    "--max_train_steps=4",
    "--validation_every=4",
    "--checkpointing_steps=4",
    "--output_dir=output/debug",
]
PROFILE = [
    "--profile_steps=3",
    "--max_train_steps=6",
    "--validation_every=6",
    "--checkpointing_steps=6",
    "--output_dir=output/profile",
]
PATH_OVERRIDE = re.compile(r"--.*_(path|file|root|dir)=.*", re.S)  # an override naming a path
OVERRIDES_HINT = "(overrides look like --key=value; see --help)"


class LaunchRefused(ValueError):
    """A command line the script cannot run: one line ``error: ...``, exit status 2."""


@dataclass
class LaunchArgs:
    """What the command line asks for."""

    num_gpus: int
    config_type: str
    config: str  # the config file, as the pre-flight and training are given it
    extra: list[str] = field(default_factory=list)  # the training overrides, the script's options expanded
    typed: list[str] = field(default_factory=list)  # the arguments, typed paths made absolute
    data: str = ""  # --data's folder or URL of clips
    debug: bool = False


def usage(bold: str = "", reset: str = "") -> str:
    presets, arguments = " ".join(preset_names()), "[custom CONFIG_PATH] [options] [--key=value ...]"
    return f"""{bold}Usage:{reset} ./train_taehv_h100.sh NUM_GPUS CONFIG_TYPE {arguments}

  NUM_GPUS      total processes (GPUs) across all nodes: 1, 8, 16, ...
  CONFIG_TYPE   a preset of training/configs/taehv_config_<CONFIG_TYPE>.py, one of
                {presets};
                or custom, which takes a config path

Options:
  --resume PATH|NAME|latest  continue a run with its own config, --key=value changes on top
                             (latest: the newest unfinished run of this config; a finished
                             run is extended by PATH or NAME with a higher --max_train_steps)
  --data DIR                 train on your own clips: annotates DIR (new files only), splits off a
                             validation set and trains on them (python -m taehv_train.training.own_data);
                             a folder or URL of shards (make_annotations --to_shards) is trained on as it is
  --debug                    a few verbose steps with anomaly detection and full tracebacks (into output/debug)
  --profile                  torch profiler trace of a few steps (into output/profile)
  --help                     this text
  --key=value                any training config override, e.g. --learning_rate=3e-4

Multi-node (run the same command on every node):
  MASTER_ADDR, MASTER_PORT (default: a free port on one node, 29500 across nodes), NNODES,
  NODE_RANK (RANK is accepted too)

Without CUDA GPUs, NUM_GPUS CPU processes are started (gloo); meant for test and demo.

Examples:
  ./train_taehv_h100.sh 1 1gpu_h100
  ./train_taehv_h100.sh 8 h100 --resume latest
  ./train_taehv_h100.sh 8 custom training/configs/my_config.py --max_train_steps=5000
  MASTER_ADDR=node1 NNODES=2 NODE_RANK=0 ./train_taehv_h100.sh 16 16gpu_h100   # node 1
  MASTER_ADDR=node1 NNODES=2 NODE_RANK=1 ./train_taehv_h100.sh 16 16gpu_h100   # node 2"""


def typed_path(value: str, caller: Path) -> str:
    """A typed path as training sees it: from the caller's folder when it exists there, else as it is."""
    if value and not value.startswith("/") and os.path.exists(f"{caller}/{value}"):
        return f"{caller}/{value}"
    return value


def config_of(args: list[str], caller: Path) -> tuple[int, str, str, list[str], list[str]]:
    """(NUM_GPUS, CONFIG_TYPE, config file, the arguments typed so far, the arguments left)."""
    if len(args) < 2:
        raise LaunchRefused("need NUM_GPUS and CONFIG_TYPE (see --help)")
    num_gpus, config_type, rest = args[0], args[1], args[2:]
    typed = [num_gpus, config_type]
    if not re.fullmatch(r"[1-9][0-9]*", num_gpus):
        raise LaunchRefused(f"NUM_GPUS must be a positive integer, got '{num_gpus}'")
    presets = preset_names()
    if config_type == "custom":
        if not rest or rest[0].startswith("--"):
            raise LaunchRefused("custom needs a config path: ./train_taehv_h100.sh N custom PATH")
        config = typed_path(rest[0], caller)
        typed.append(config)
        rest = rest[1:]
    elif config_type in presets:
        config = os.path.relpath(preset_file(config_type))
    else:
        raise LaunchRefused(f"unknown CONFIG_TYPE '{config_type}' ({' '.join(presets)}, custom)")
    if not os.path.isfile(config):
        raise LaunchRefused(f"config file {config} not found")
    return int(num_gpus), config_type, config, typed, rest


def parse(argv: list[str], caller: Path) -> LaunchArgs:
    """The command line (``--help`` is the caller's to answer first); ``LaunchRefused`` for a mistake."""
    num_gpus, config_type, config, typed, rest = config_of(argv, caller)
    args = LaunchArgs(num_gpus, config_type, config, typed=typed)
    while rest:
        arg, rest = rest[0], rest[1:]
        if arg not in ("--resume", "--data"):
            args.typed.append(arg)
        if arg in ("--resume", "--data"):
            if not rest:
                raise LaunchRefused(
                    "--resume needs PATH, NAME or latest" if arg == "--resume" else "--data needs a folder of videos"
                )
            value, rest = typed_path(rest[0], caller), rest[1:]
            if arg == "--resume":
                args.extra.append(f"--resume_from_checkpoint={value}")
                args.typed += ["--resume", value]
            else:
                args.data = value
                args.typed.append(f"--data={value}")
        elif arg.startswith("--resume="):
            args.extra.append(f"--resume_from_checkpoint={typed_path(arg.removeprefix('--resume='), caller)}")
        elif arg == "--debug":
            args.extra += DEBUG
            args.debug = True
        elif arg == "--profile":
            args.extra += PROFILE
        elif arg.startswith("--data="):
            args.data = typed_path(arg.removeprefix("--data="), caller)
            args.typed[-1] = f"--data={args.data}"
        elif PATH_OVERRIDE.fullmatch(arg):
            key, _, value = arg.partition("=")
            args.typed[-1] = f"{key}={typed_path(value, caller)}"
            args.extra.append(args.typed[-1])
        elif arg.startswith("--") and "=" in arg:
            args.extra.append(arg)
        elif arg.startswith("--"):
            close = difflib.get_close_matches(arg, OPTIONS, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise LaunchRefused(f"unexpected argument '{arg}'{hint} {OVERRIDES_HINT}")
        else:
            raise LaunchRefused(f"unexpected argument '{arg}' {OVERRIDES_HINT}")
    return args
