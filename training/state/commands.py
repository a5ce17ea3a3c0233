"""The commands a run's messages print: the one that started it, the one that resumes it,
the one to run after a failure that left the run as it was, and those that evaluate and
export a finished run. Training and the launcher (``training.launch``, which reports a
training process that died) print the same ones."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from taehv_train.common.config import REPO_ROOT
from taehv_train.training.loop.distributed import started_command
from taehv_train.training.state.run_folders import list_checkpoints


def launch_command() -> list[str]:
    """The command that started this run: the launch script's or the launcher's (passed in
    TAEHV_LAUNCH_COMMAND), else this module's (``python -m taehv_train.training.taehv_train ...``)."""
    launch = os.environ.get("TAEHV_LAUNCH_COMMAND")
    return shlex.split(launch) if launch else started_command("taehv_train.training.taehv_train", sys.argv[1:])


def resume_command(checkpoint: Path | str = "latest") -> str:
    """The command that continues this run from ``checkpoint``: the one that started it,
    any earlier ``--resume`` replaced."""
    kept, skip = [], False
    for word in launch_command():
        if skip or word.startswith(("--resume=", "--resume_from_checkpoint=")):
            skip = False
            continue
        skip = word == "--resume"
        if not skip:
            kept.append(word)
    return shlex.join([*kept, "--resume", str(checkpoint)])


def next_command(run_dir: Path | None) -> str:
    """After a failure that leaves the run as it was: the command that resumes it when it
    holds a checkpoint, else the one that starts it again (also when the run folder is not
    known)."""
    if run_dir is not None and list_checkpoints(run_dir / "checkpoints"):
        return f"resume with: {resume_command()}"
    return f"start again with: {shlex.join(launch_command())} (nothing to resume yet)"


def next_steps(run_dir: Path) -> list[tuple[str, str]]:
    """The commands that evaluate and export a finished run (its folder is all they need),
    with this interpreter and absolute paths: they work from any folder."""
    run = run_dir.resolve()
    evaluate = [
        sys.executable,
        str(REPO_ROOT / "inference.py"),
        "--model_path",
        str(run),
        "--output_dir",
        str(run / "eval"),
    ]
    export = [sys.executable, "-m", "taehv_train.training.export", str(run), "--out", f"{run}_tae"]
    return [("evaluate it", shlex.join(evaluate)), ("export it", shlex.join(export))]
