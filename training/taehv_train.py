#!/usr/bin/env python3
"""Train or fine-tune a TAEHV in a reference VAE's latent space.

    accelerate launch --config_file accelerate_configs/deepspeed_8gpu.yaml \
        -m taehv_train.training.taehv_train --config training/configs/taehv_config_h100.py [--key=value ...]
    python -m taehv_train.training.taehv_train --config training/configs/taehv_config_demo.py   # one process

Set-up, then one loop under Accelerate (1 process, DDP or DeepSpeed ZeRO-2; gloo on CPU):
the data and its reference latents come from ``training.data.loading``; each accumulation
window, from its micro-batches to the optimizer step, is one call of
``training.loop.step.TrainStep``; after it the loop (``training.loop.training_run``) does
what the time budget says follows the step: logs to TensorBoard, validates (best model,
early stopping), writes atomic checkpoints that resume bit-identically and decides whether
to stop; the run ends (``finish``) with a final fp32 export in the published key format.

Exit status: 0 when training finished, stopped early, or stopped on SIGTERM/SIGINT (after
saving a checkpoint; during start-up there is nothing to save); 1 when it gave up after too
many skipped steps (a checkpoint is saved first); 2 for a problem the user fixes, in one
line (configuration, data, a damaged or mismatched checkpoint, a full disk; the training
data gone mid-run, after a checkpoint); 3 when another process of the run died or was
killed (``training.launch`` then exits 128 + that process's signal); 4 when the optimizer
step ran out of memory (nothing saved after the last checkpoint); 130 when a second
Ctrl+C interrupted it at once. The line ends with the exact command that resumes the run
where there is one to resume; ``--debug`` keeps the traceback.
"""

from __future__ import annotations

import signal
import time

if __name__ == "__main__":  # a stop signal that arrives while the libraries load is kept for later
    PROCESS_STARTED = time.perf_counter()  # a time budget counts the libraries' loading too
    EARLY_SIGNALS: list[int] = []
    for _sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(_sig, lambda signum, frame: EARLY_SIGNALS.append(signum))
    from taehv_train.common.lifeline import end_with_launcher

    end_with_launcher()  # before the seconds of imports: a launcher that dies then takes this process with it

import logging
import os
import shlex
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from taehv_train.base.atomic import atomic_write
from taehv_train.base.errors import EXIT_USER_ERROR, USER_ERRORS, UserError, debug_requested
from taehv_train.base.flags import ArgumentParser
from taehv_train.base.process_exit import exit_without_teardown
from taehv_train.common.clips import VideoDataError, frames_to_unit
from taehv_train.common.config import TrainConfig, describe, given_keys, load_config
from taehv_train.common.reference_vae import ReferenceVAE
from taehv_train.common.run_files import run_weights, write_run_marker
from taehv_train.models.latent_spaces import OWN
from taehv_train.training.data.latent_scale_check import check_at_start
from taehv_train.training.data.loader_workers import LoaderFault
from taehv_train.training.data.loading import (
    TrainingData,
    build_train_loader,
    build_training_data,
    check_full_batches,
)
from taehv_train.training.data.prefetch import Prefetcher
from taehv_train.training.export import BUNDLE_FOLDER, write_bundle
from taehv_train.training.launch_check import training_notes
from taehv_train.training.loop.accelerator import make_accelerator, setup_logging
from taehv_train.training.loop.best_model import BestTracker
from taehv_train.training.loop.distributed import process_state
from taehv_train.training.loop.expectations import warn_if_short
from taehv_train.training.loop.forward import build_model
from taehv_train.training.loop.monitoring import Monitor
from taehv_train.training.loop.progress import Progress
from taehv_train.training.loop.resilience import (
    EXIT_OUT_OF_MEMORY,
    EXIT_RANK_LOST,
    FaultPlan,
    StopRequest,
    agree,
    lost_rank_cause,
)
from taehv_train.training.loop.step import OUT_OF_MEMORY_ADVICE, OptimizerStepFailed, TrainStep
from taehv_train.training.loop.time_budget import ProcessClock, TimeBudget, keeps_plan
from taehv_train.training.loop.training_run import TrainingRun, train_windows
from taehv_train.training.loop.validation import ValidationDataError
from taehv_train.training.state.atomic_folders import DiskFullError, is_disk_full
from taehv_train.training.state.checkpoints import load_training_state, remove_partial_checkpoints
from taehv_train.training.state.commands import launch_command, next_command, next_steps, resume_command
from taehv_train.training.state.run_config import Start, describe_start
from taehv_train.training.state.run_data import data_record
from taehv_train.training.state.run_lock import release_run_dir
from taehv_train.training.state.run_start import claim_run_dir, decide_start
from taehv_train.training.state.trained_weights import export_weights

logger = logging.getLogger("taehv_train")


EXIT_SKIPPED_STEPS, EXIT_INTERRUPTED = 1, 130


class TrainingAborted(RuntimeError):
    """The run cannot go on (e.g. every step is non-finite); a checkpoint was saved first."""


class DataGone(UserError):
    """The training or validation data became unreadable mid-run; a checkpoint was saved first."""


class OutOfMemoryInStep(RuntimeError):
    """The optimizer step ran out of memory: the run ends without saving (its state may be
    half-updated), with the command that resumes from the last checkpoint."""


class RankLost(RuntimeError):
    """Another process of the run died or was killed: the collectives cannot go on, and
    nothing can be saved (the launcher names the process that died)."""


def parse_args(argv: list[str] | None = None) -> tuple[str, list[str]]:
    """(config file, ``--key=value`` overrides as typed)."""
    parser = ArgumentParser(description="Train a TAEHV (see README).", allow_abbrev=False)
    parser.add_argument("--config", required=True, help="Python config file defining `config`")
    parser.add_argument("--resume", default=None, help="shorthand for --resume_from_checkpoint")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    args, overrides = parser.parse_known_args(argv)
    if args.resume:
        overrides.append(f"--resume_from_checkpoint={args.resume}")
    return args.config, overrides


def main(argv: list[str] | None = None, stop: StopRequest | None = None, started: float | None = None) -> Path:
    """Train as the config says; returns the run directory. ``stop`` is installed by the
    caller before anything slow, so that a signal during start-up is not lost; ``started``:
    ``time.perf_counter()`` when this process started, before it loaded the libraries (a time
    budget counts the start-up from then, or from the launch's start; default: now)."""
    clock = ProcessClock.measure(started)
    stop = stop or StopRequest()
    config_file, overrides = parse_args(argv)
    base = load_config(config_file, overrides)
    start = decide_start(process_state(base.batch_timeout), base, overrides)
    config = start.config
    notes = training_notes(config)
    faults = FaultPlan.parse(config.fault_injection)
    if start.done:
        logger.warning("%s", describe_start(start))
        return start.run
    run_dir, lock = claim_run_dir(process_state(), start)
    tell_launcher("TAEHV_RUN_DIR_FILE", str(run_dir))
    accelerator = make_accelerator(config, run_dir)
    setup_logging(run_dir, accelerator)
    for note in notes:
        logger.info(note)
    logger.info(
        "run directory %s; %d process(es), %s, mixed precision %s",
        run_dir,
        accelerator.num_processes,
        accelerator.distributed_type,
        config.mixed_precision,
    )
    if accelerator.is_main_process:
        remove_partial_checkpoints(run_dir / "checkpoints")
    set_seed(config.seed)  # identical initial weights on every rank
    torch.autograd.set_detect_anomaly(config.detect_anomaly)
    log_every_typed = "log_every" in given_keys(overrides)
    try:
        return train(config, accelerator, run_dir, start, faults, stop, clock, log_every_typed)
    except Exception as err:  # a full disk, or another process gone: say what to run next
        if is_disk_full(err):
            what = str(err) if isinstance(err, DiskFullError) else f"no space left on the device of {run_dir} ({err})"
            raise DiskFullError(f"{what}, then {next_command(run_dir)}") from err
        if isinstance(err, OptimizerStepFailed):
            raise OutOfMemoryInStep(
                f"{err}: the weights may be half-updated, so nothing after the last checkpoint was saved; "
                f"{OUT_OF_MEMORY_ADVICE}, then {next_command(run_dir)}"
            ) from err
        if (cause := lost_rank_cause(err)) is not None and torch.distributed.is_initialized():
            raise RankLost(
                f"lost contact with another process of the run ({cause}): it died or was killed; nothing was saved "
                f"after the last checkpoint; {next_command(run_dir)}"
            ) from err
        raise
    finally:
        if lock is not None:
            release_run_dir(lock)


def train(
    config: TrainConfig,
    accelerator: Accelerator,
    run_dir: Path,
    start: Start,
    faults: FaultPlan,
    stop: StopRequest,
    clock: ProcessClock,
    log_every_typed: bool = False,
) -> Path:
    """Build the model, data and step, restore the checkpoint ``start`` resumes, and run the
    loop to its end (``training.loop.training_run.train_windows``). ``log_every_typed``: the
    command line set ``log_every`` (kept as typed, ``training.loop.monitoring.log_interval``)."""
    resume_from = start.checkpoint
    model = build_model(config, resumed=resume_from is not None)
    ref_vae = ReferenceVAE.from_config(config, accelerator.device) if config.ref_vae_path else None
    # the space its weights are saved with, and the reference statistics behind it
    model.latent_space, model.latent_transform = (
        (ref_vae.transform.space, ref_vae.transform) if ref_vae else (OWN, None)
    )
    data = build_training_data(config, ref_vae)
    check_full_batches(data.train, config.train_batch_size, accelerator.num_processes)
    train_step, loader = TrainStep.build(
        config,
        accelerator,
        model,
        data.latents,
        faults,
        stop,
        loader=build_train_loader(data.train, config, accelerator.device, accelerator.num_processes),
    )
    progress = Progress()
    tracker = BestTracker(config.best_metric, config.early_stopping_patience, config.early_stopping_min_delta)
    if resume_from is not None:
        saved = load_training_state(train_step.objects, resume_from)
        progress = Progress(**saved["progress"])
        # a new length: a time budget plans again
        if start.extending or not keeps_plan(saved.get("config", {}), config):
            progress.forget_plan()
        tracker = BestTracker.replay(
            saved["validation_history"],
            config.best_metric,
            config.early_stopping_patience,
            config.early_stopping_min_delta,
            since=start.step if start.new_validation_set else saved.get("best_model_since", -1),
        )
        if start.new_validation_set:
            logger.warning(
                "the validation clips changed: the best-model comparison restarts at step %d (%s is replaced at "
                "the next validation; the scores before it were of other clips)",
                start.step,
                run_dir / "best_model",
            )
        logger.info(
            "resumed from %s; data position: epoch %d, batch %d",
            describe_start(start),
            progress.epoch,
            progress.batch_in_epoch,
        )
    # the schedule's horizon: the step count a time budget fixed, else this start's max_train_steps
    train_step.schedule.total = (progress.planned_steps or config.max_train_steps) * accelerator.num_processes
    processes, device = accelerator.num_processes, accelerator.device
    budget = TimeBudget(config, progress, train_step.schedule, processes, clock.started, device, clock.exiting)
    if budget.budget is None and accelerator.is_main_process:
        warn_if_short(config, config.max_train_steps)
    if data.latents.available:  # a run from published or earlier weights must already be on the reference scale
        check_latent_scale(train_step, data, pretrained=bool(config.pretrained_model_path))
    if accelerator.is_main_process:  # only once the start-up worked: a failed resume leaves the run as it was
        atomic_write(run_dir / "config.json", describe(config))
        with open(run_dir / "command.txt", "a") as commands:  # every start of the run, for the model card
            commands.write(shlex.join(launch_command()) + "\n")
        if start.extending:  # unfinished again until its new end (final_model.* is replaced then)
            write_run_marker(run_dir, {"reason": "extending", "step": start.step})
    if agree([stop.requested], accelerator.device)[0]:
        logger.info(
            "stopped on %s during start-up, before the first step: nothing new to save",
            stop.signal_name or "a signal received by another rank",
        )
        accelerator.end_training()
        return run_dir
    monitor = Monitor(accelerator, config, run_dir, progress.step, train_step.idle, log_every_typed)
    run = TrainingRun(
        config, run_dir, train_step, progress, tracker, monitor, faults, data.val, ref_vae, data_record(config)
    )
    progress_bar = tqdm(
        total=budget.last_step,
        initial=progress.step,
        desc="train",
        dynamic_ncols=True,
        disable=not accelerator.is_local_main_process,
    )
    profiler = monitor.profiler()
    # from where the run is, epoch after epoch, received while the step computes; a wait for a batch
    # ends at a stop request or after batch_timeout seconds
    batches = Prefetcher(
        loader,
        accelerator,
        progress,
        config.prefetch_batches,
        stopping=lambda: stop.requested,
        batch_timeout=config.batch_timeout,
        faults=faults,
    )
    try:
        with logging_redirect_tqdm():  # log lines go above the progress bar, not into it
            stop_reason, data_error = train_windows(run, batches, budget, progress_bar, profiler)
    finally:
        batches.close()

    if profiler is not None:
        profiler.stop()
    progress_bar.close()
    return finish(stop_reason, run, stop, data_error)


@torch.no_grad()
def check_latent_scale(train_step: TrainStep, data: TrainingData, pretrained: bool, clips: int = 2) -> None:
    """The model's latents of a few training clips against their reference latents
    (``training.data.latent_scale_check``); draws nothing from the run's random streams."""
    device = train_step.accelerator.device
    items = [data.train[i] for i in range(min(clips, len(data.train)))]
    batch = {key: torch.stack([item[key] for item in items]) for key in ("frames", "latents") if key in items[0]}
    frames = frames_to_unit(batch["frames"], device)
    reference = data.latents(batch, frames, torch.Generator(device).manual_seed(0))
    vae = data.latents.vae
    check_at_start(
        train_step.unwrapped_model.encode_video(frames.to(train_step.input_dtype)),
        reference,
        pretrained,
        vae.transform,
        vae.spaces(),
    )


def finish(stop_reason: str, run: TrainingRun, stop: StopRequest, data_error: VideoDataError | None) -> Path:
    """Save what the way the run stopped calls for: a checkpoint after a signal, too many
    skipped steps (then exit 1) or the training or validation data going away (then exit 2), a checkpoint and the
    final export after early stopping, the final export when it finished."""
    progress, run_dir, train_step = run.progress, run.run_dir, run.train_step
    accelerator = train_step.accelerator
    if stop_reason in ("signal", "skipped", "data"):
        path = run.checkpoint()
        accelerator.end_training()
        if stop_reason == "skipped":
            raise TrainingAborted(
                f"{progress.consecutive_skips} steps in a row were skipped (non-finite loss or gradient, or out of "
                f"memory); saved {path}. Lower learning_rate, enable max_grad_norm, use bf16 instead of fp16, or "
                f"check the data and the reference VAE, then resume with: {resume_command(path)}"
            )
        if stop_reason == "data" and isinstance(data_error, LoaderFault):
            raise DataGone(
                f"the data loader failed at step {progress.step}: {data_error.reason}; saved {path}. "
                f"{data_error.advice}, then resume with: {resume_command(path)}"
            )
        if stop_reason == "data" and data_error is None:
            raise DataGone(
                f"the training data became unreadable at step {progress.step} on another process of the run, or "
                f"its loader failed there (that process's line says which); saved {path}. Fix that, then resume "
                f"with: {resume_command(path)}"
            )
        if stop_reason == "data":
            cause = data_error.reason
            which = "validation" if isinstance(data_error, ValidationDataError) else "training"
            raise DataGone(
                f"the {which} data became unreadable at step {progress.step} ({cause}); "
                f"saved {path}. Restore the data, then resume with: {resume_command(path)}"
            )
        logger.info(
            "stopped on %s at step %d; saved %s. Resume with: %s",
            stop.signal_name or "a signal received by another rank",
            progress.step,
            path,
            resume_command(path),
        )
        return run_dir
    if stop_reason == "early_stop":
        tracker = run.tracker
        logger.info(
            "early stopping at step %d: %s did not improve for %d validations (best %.4f at step %s)",
            progress.step,
            run.config.best_metric,
            tracker.bad_validations,
            tracker.best_value,
            tracker.best_step,
        )
        run.checkpoint()
    export_weights(
        accelerator, train_step.model, train_step.ema, run_dir, "final_model", frozen=train_step.objects.frozen
    )
    if accelerator.is_main_process:
        logger.info("saved %s and %s", run_dir / "final_model.pth", run_dir / "final_model.safetensors")
        write_run_marker(
            run_dir, {"step": progress.step, "reason": stop_reason, "max_train_steps": run.config.max_train_steps}
        )
        chosen = run_weights(run_dir)  # finished: what the tools take for the run folder
        bundle = write_bundle(
            chosen, run_dir / BUNDLE_FOLDER, command="training/taehv_train.py at the end of the run", overwrite=True
        )
        logger.info(
            "wrote the export bundle %s (%s): %s",
            run_dir / BUNDLE_FOLDER,
            ", ".join(p.name for p in bundle),
            chosen.told,
        )
        for what, command in next_steps(run_dir):
            logger.info("%s: %s", what, command)
    accelerator.end_training()
    return run_dir


def tell_launcher(variable: str, text: str) -> None:
    """Leave ``text`` in the file that ``training.launch`` names in ``variable`` (written by
    each node's first process): how training ended (TAEHV_EXIT_STATUS_FILE), which a
    launcher that is itself signalled cannot tell, as it exits non-zero even when training
    stopped cleanly; the run folder (TAEHV_RUN_DIR_FILE), which the launcher's line names
    when a process dies."""
    target = os.environ.get(variable)
    if target and os.environ.get("LOCAL_RANK", "0") == "0":
        atomic_write(target, text)


def entry_point(argv: list[str] | None = None, early_signals: list[int] = (), started: float | None = None) -> None:
    """Run training and exit with the documented status; every ending that is not a crash
    is one line on stderr and in train.log (when the run got that far). ``started``: as for ``main``."""
    stop = StopRequest().install()
    for signum in early_signals:
        stop.receive(signum)
    status = 0
    try:
        main(argv, stop, started)
    except USER_ERRORS as err:
        if debug_requested(argv):
            raise
        logger.error("error: %s", err)
        status = EXIT_USER_ERROR
    except TrainingAborted as err:
        logger.error("%s", err)
        status = EXIT_SKIPPED_STEPS
    except RankLost as err:
        logger.error("%s", err)
        status = EXIT_RANK_LOST
    except OutOfMemoryInStep as err:
        logger.error("%s", err)
        status = EXIT_OUT_OF_MEMORY
    except KeyboardInterrupt:
        logger.error("interrupted at once by a second Ctrl+C: nothing saved since the last checkpoint")
        status = EXIT_INTERRUPTED
    tell_launcher("TAEHV_EXIT_STATUS_FILE", f"{status}\n")
    sys.exit(status)


if __name__ == "__main__":
    with exit_without_teardown():
        entry_point(early_signals=EARLY_SIGNALS, started=PROCESS_STARTED)
