"""The experiment trackers a run reports to (``report_to``).

``report_to`` lists, comma-separated, trackers that Accelerate integrates
(``accelerate/tracking.py``, ``LOGGER_TYPE_TO_CLASS``), or ``all`` for every one installed;
TensorBoard is the default. Every tracker receives the same scalars under the same tags at
the same steps (``Accelerator.log``), and the run's hyperparameters at its first start.
TensorBoard alone receives the reconstruction strips and keeps the hyperparameters in its
HPARAMS tab. Trackers other than TensorBoard are optional extras: Accelerate leaves out a
named tracker that is not installed without a word (``filter_trackers``), so ``config_errors``
refuses it, with the pip command, before any heavy work.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from accelerate import Accelerator
from accelerate.tracking import GeneralTracker, TensorBoardTracker, get_available_trackers
from accelerate.utils import LoggerType

from taehv_train.common.config import TrainConfig

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

logger = logging.getLogger(__name__)
TENSORBOARD = "tensorboard"
ALL = "all"
# what the hosted trackers file the runs under (MLflow's experiment, W&B's project, ...)
PROJECT = "taehv-train"
# the pip argument that installs each tracker (the packages accelerate/utils/imports.py looks for;
# Aim must be older than 4 there)
INSTALL = {
    TENSORBOARD: "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
    "comet_ml": "comet_ml",
    "aim": "'aim<4'",
    "clearml": "clearml",
    "dvclive": "dvclive",
    "swanlab": "swanlab",
    "trackio": "trackio",
}
HPARAM_TYPES = (int, float, str, bool)


def listed(report_to: str) -> list[str]:
    """The names ``report_to`` lists, in its order, each once."""
    return list(dict.fromkeys(name.strip() for name in report_to.split(",") if name.strip()))


def installed() -> list[str]:
    """The trackers Accelerate finds installed here."""
    found = {str(tracker.value) for tracker in get_available_trackers()}
    return [name for name in INSTALL if name in found]


def tracker_names(config: TrainConfig) -> list[str]:
    """The trackers the run reports to: ``report_to``'s, ``all`` standing for every installed one."""
    names = listed(config.report_to)
    return installed() if ALL in names else names


def config_errors(config: TrainConfig) -> list[str]:
    """An empty ``report_to``, an unknown tracker, one that this Accelerate does not
    integrate yet, and one that is not installed (with its pip command)."""
    names = listed(config.report_to)
    if not names:
        return [f"report_to is empty: name a tracker, e.g. {TENSORBOARD}"]
    found = [
        f"report_to: unknown tracker {name!r}; expected {ALL} or one of {', '.join(INSTALL)}"
        for name in names
        if name not in INSTALL and name != ALL
    ]
    integrated, here = LoggerType.list(), installed()
    for name in (name for name in names if name in INSTALL):
        if name not in integrated:
            found.append(f"report_to: this Accelerate does not integrate {name} yet: pip install -U accelerate")
        elif name not in here:
            found.append(f"report_to: {name} is not installed: pip install {INSTALL[name]}")
    return found


def log_with(config: TrainConfig, run_dir: Path) -> list[str | GeneralTracker]:
    """The Accelerator's ``log_with``: TensorBoard as a tracker of its own that writes into
    ``run_dir/logs`` (Accelerate would write into a folder named after the project), the
    others by name."""
    return [TensorBoardTracker("logs", run_dir) if name == TENSORBOARD else name for name in tracker_names(config)]


def init_kwargs(run_dir: Path) -> dict[str, dict]:
    """What each tracker names the run (the run directory's name) and where those that write
    files keep them (in the run directory); arguments of accelerate/tracking.py's tracker
    classes, or of the call their ``start`` makes."""
    return {
        "wandb": {"name": run_dir.name, "dir": str(run_dir)},  # wandb.init
        "mlflow": {"run_name": run_dir.name},  # MLflowTracker
        "clearml": {"task_name": run_dir.name},  # clearml.Task.init
        "dvclive": {"dir": str(run_dir / "dvclive")},  # dvclive.Live
    }


def tensorboard_hparams(config: TrainConfig) -> dict:
    """The config values of the types TensorBoard's hparams accept (others raise ValueError
    there); every tracker records these as the run's hyperparameters."""
    return {k: v for k, v in config.to_dict().items() if isinstance(v, HPARAM_TYPES)}


def start_trackers(accelerator: Accelerator, config: TrainConfig, run_dir: Path, first_start: bool) -> None:
    """Start the trackers (main process) and, at the run's first start, record its
    hyperparameters in each. TensorBoard's go into the run's own folder: Accelerate's
    hyperparameter logging writes a new time-stamped folder at every start, which
    TensorBoard shows as another run."""
    accelerator.init_trackers(PROJECT, init_kwargs=init_kwargs(run_dir))
    if accelerator.is_main_process:  # the trackers live there
        logger.info("reporting to %s", ", ".join(tracker.name for tracker in accelerator.trackers))
    if not first_start:
        return
    hparams = tensorboard_hparams(config)
    for tracker in accelerator.trackers:
        if tracker.name == TENSORBOARD:
            tracker.tracker.add_hparams(hparams, {}, run_name=".")
        else:
            tracker.store_init_configuration(hparams)


def tensorboard_writer(accelerator: Accelerator) -> SummaryWriter | None:
    """TensorBoard's SummaryWriter when the run reports to TensorBoard (main process), else None."""
    return next((t.tracker for t in accelerator.trackers if t.name == TENSORBOARD), None)
