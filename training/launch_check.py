"""The launch script's pre-flight, run in a process of its own (``checked``): the visible
GPUs, and the config with its paths, data, reference VAE, frame counts and resume checked,
as training will see them. Its own process, so that the launcher, which waits on training
for the whole run, holds no library, CUDA state or memory of the check.

What the check prints (its notes, a library's warnings) is kept in ``Check.output``, which
the launch script prints after its own lines on the environment and the GPUs. The training
processes of the launch get its notes (``CHECKED_NOTES``) and log them without checking
again (``training_notes``); a training process started otherwise checks for itself. The
libraries are imported inside the functions, so that the launcher never loads them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from taehv_train.common.config import TrainConfig

# the packages training needs: without one, the script says how to install them
PACKAGES = ("taehv_train", "torch", "accelerate", "deepspeed", "diffusers")
# the pre-flight's notes, as JSON, for the training processes of the launch, which log them without checking again
CHECKED_NOTES = "TAEHV_PREFLIGHT_NOTES"


@dataclass
class Check:
    """How the pre-flight went."""

    gpus: int  # the CUDA devices this node sees
    output: str = ""  # what the check printed: notes, warnings, the data line
    notes: tuple[str, ...] = ()  # the config check's notes, which training logs
    error: str = ""  # a problem the user fixes: "error: ..." (with one line each below it for several)
    crash: str = ""  # an unexpected failure: its traceback
    done: str = ""  # a finished run with nothing to do: the line that says so
    resume: str = ""  # a resume: from which checkpoint of which run


def checked(config_file: str, overrides: list[str], local_processes: int) -> Check:
    """The pre-flight of ``config_file`` with ``overrides`` (``--debug`` is no config key),
    for ``local_processes`` training processes on this machine, which share its RAM."""
    os.environ["LOCAL_WORLD_SIZE"] = str(local_processes)  # as the launcher will set it for them
    import torch

    from taehv_train.base.errors import USER_ERRORS

    check = Check(gpus=torch.cuda.device_count())
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        try:
            check_config(check, config_file, [arg for arg in overrides if arg != "--debug"])
        except USER_ERRORS as err:
            check.error = f"error: {err}"
        except Exception:  # a bug: its traceback is the report, which the launch script prints
            check.crash = traceback.format_exc()
    check.output = output.getvalue()
    return check


def check_config(check: Check, config_file: str, overrides: list[str]) -> None:
    from taehv_train.common.config import load_config
    from taehv_train.training.preflight import notes_of
    from taehv_train.training.state.run_config import describe_start, start_of

    # a resume takes the run's own config (a damaged checkpoint or a finished run stops here)
    start = start_of(load_config(config_file, overrides), overrides)
    config = start.config
    check.notes = tuple(notes_of(config))
    for note in check.notes:
        print(f"  note: {note}")
    if start.done:
        check.done = describe_start(start)
    elif start.checkpoint is not None:
        check.resume = f"from {describe_start(start)}"
    reference = config.ref_vae_path or "none (plain autoencoder)"
    print(f"  data: {config.annotation_file or config.data_root}; reference VAE: {reference}")


def training_notes(config: TrainConfig) -> list[str]:
    """In a training process: the notes of the pre-flight its launch script ran, else
    those of its own (``training.preflight.notes_of``)."""
    from taehv_train.training.preflight import notes_of

    told = os.environ.get(CHECKED_NOTES)
    return json.loads(told) if told is not None else notes_of(config)
