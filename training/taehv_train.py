#!/usr/bin/env python3
"""Train or fine-tune a TAEHV in a reference VAE's latent space.

    accelerate launch --config_file accelerate_configs/deepspeed_8gpu.yaml \
        training/taehv_train.py --config training/configs/taehv_config_h100.py [--key=value ...]
    python training/taehv_train.py --config training/configs/taehv_config_demo.py   # one process

One readable loop under Accelerate (1 process, DDP or DeepSpeed ZeRO-2; gloo on CPU):
reference latents from the frozen VAE, the model called through ``forward``, losses on
frames aligned by the model's FramePlan, EMA weights, TensorBoard, validation with the
best model and early stopping, atomic checkpoints that resume bit-identically, and a
final fp32 export in the published key format.

Exit status: 0 when training finished, stopped early, or stopped on SIGTERM/SIGINT after
saving a checkpoint (resume with ``--resume latest``); 1 when it gave up after too many
skipped steps (a checkpoint is saved first); 2 for a configuration error.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from accelerate import Accelerator, PartialState  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, DistributedType, InitProcessGroupKwargs, set_seed  # noqa: E402
from diffusers.optimization import get_scheduler  # noqa: E402
from diffusers.training_utils import EMAModel  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from models.checkpoint import save_weights  # noqa: E402
from models.seraena import Seraena  # noqa: E402
from models.taehv import TAEHV, AutoencoderOutput  # noqa: E402
from training.best_model import BestTracker  # noqa: E402
from training.adversarial import build_seraena, seraena_loss  # noqa: E402
from training.checkpointing import (  # noqa: E402
    TrainingObjects,
    load_training_state,
    new_run_dir,
    remove_partial_checkpoints,
    resolve_resume,
    save_checkpoint,
    write_atomically,
)
from training.config import ConfigError, TrainConfig, check, describe, exit_on_config_error, load_config, resolve_path  # noqa: E402
from training.cache_latents import CachedLatentDataset  # noqa: E402
from training.dataset import VideoClipDataset, build_dataloader  # noqa: E402
from training.distributed import process_group_backend, process_state  # noqa: E402
from training.losses import compute_losses  # noqa: E402
from training.monitoring import Monitor  # noqa: E402
from training.resilience import FaultPlan, StopRequest, agree, broadcast_flag, is_finite_number, poisoned  # noqa: E402
from training.utils import ReferenceVAE  # noqa: E402
from training.validation import validate  # noqa: E402

logger = logging.getLogger("taehv_train")


class TrainingAborted(RuntimeError):
    """The run cannot go on (e.g. every step is non-finite); a checkpoint was saved first."""


@dataclass
class Progress:
    """Where the run is: saved in every checkpoint so a resumed run continues identically."""

    step: int = 0  # optimizer steps applied
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch already consumed (per process)
    skipped_steps: int = 0  # steps skipped on all ranks (non-finite loss/gradient, out of memory)
    consecutive_skips: int = 0


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    parser = argparse.ArgumentParser(description="Train a TAEHV (see README).", allow_abbrev=False)
    parser.add_argument("--config", required=True, help="Python config file defining `config`")
    parser.add_argument("--resume", default=None, help="shorthand for --resume_from_checkpoint")
    args, overrides = parser.parse_known_args(argv)
    if args.resume:
        overrides.append(f"--resume_from_checkpoint={args.resume}")
    return load_config(args.config, overrides)


def make_accelerator(config: TrainConfig, run_dir: Path) -> Accelerator:
    """Accelerator whose accumulation and clipping come from the Python config only."""
    for env, value in (("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", config.gradient_accumulation_steps),
                       ("ACCELERATE_GRADIENT_CLIPPING", config.max_grad_norm)):
        given = os.environ.get(env)
        if given not in (None, "auto") and float(given) != float(value):
            raise ConfigError(
                f"the accelerate config sets {env.removeprefix('ACCELERATE_').lower()}={given} but the training "
                f"config says {value}: remove it from the accelerate YAML (the Python config is the single source)")
        os.environ[env] = str(value)  # DeepSpeed's plugin reads these
    backend = process_group_backend()
    return Accelerator(
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        mixed_precision=config.mixed_precision,
        log_with="tensorboard",
        project_dir=str(run_dir),
        kwargs_handlers=[InitProcessGroupKwargs(backend=backend)] if backend else [],
        # pinned batches copied asynchronously to the GPU (the loader pins them on CUDA)
        dataloader_config=DataLoaderConfiguration(non_blocking=torch.cuda.is_available()),  # device is cuda iff available
    )


def decide_run_dir(state: PartialState, config: TrainConfig) -> tuple[Path, Path | None]:
    """(run directory, checkpoint to resume), decided once on the main process and shared,
    so every rank writes to the same place; a resumed run continues in its own directory."""
    decision = [None]
    if state.is_main_process:
        run_dir, checkpoint = resolve_resume(config)
        decision[0] = (str(run_dir or new_run_dir(config)), str(checkpoint) if checkpoint else None)
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(decision, src=0)
    run_dir, checkpoint = Path(decision[0][0]), decision[0][1] and Path(decision[0][1])
    if state.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
    state.wait_for_everyone()
    return run_dir, checkpoint


def setup_logging(run_dir: Path, accelerator: Accelerator) -> None:
    level = logging.INFO if accelerator.is_main_process else logging.WARNING
    handlers = [logging.StreamHandler()]
    if accelerator.is_main_process:
        handlers.append(logging.FileHandler(run_dir / "train.log"))
    logging.basicConfig(level=level, handlers=handlers, force=True,
                        format=f"%(asctime)s [rank {accelerator.process_index}] %(levelname)s %(name)s: %(message)s")


def build_model(config: TrainConfig) -> TAEHV:
    if config.pretrained_model_path:
        model = TAEHV(resolve_path(config.pretrained_model_path), variant=config.variant)
        logger.info("initialised from %s", config.pretrained_model_path)
    else:
        model = TAEHV(variant=config.variant)
        with torch.no_grad():
            model.decoder[-1].bias.fill_(config.decoder_bias_init)  # start from mid-grey frames
        logger.info("training %s from scratch", config.variant)
    return model


def build_datasets(config: TrainConfig) -> tuple[VideoClipDataset, VideoClipDataset | None]:
    common = dict(n_frames=config.n_frames, height=config.height, width=config.width, seed=config.seed,
                  short_clip_policy=config.short_clip_policy, max_failure_fraction=config.max_failure_fraction)
    data_root = resolve_path(config.data_root) if config.data_root else None
    train = VideoClipDataset(
        data_root, resolve_path(config.annotation_file) if config.annotation_file else None, mode="train",
        stride_range=(config.stride_min, config.stride_max), crop_scale=(config.crop_scale_min, config.crop_scale_max),
        hflip=config.hflip, **common)
    val = None
    if config.val_annotation_file and config.num_validation_samples > 0:
        val = VideoClipDataset(data_root, resolve_path(config.val_annotation_file), mode="val",
                               stride_range=(config.stride_min, config.stride_max), **common)
    return train, val


def fp32_weights(accelerator: Accelerator, model: torch.nn.Module, ema: EMAModel | None) -> dict[str, torch.Tensor]:
    """Full fp32 weights in the published key format: the EMA weights when kept, else the
    optimizer's fp32 master weights (DeepSpeed bf16/fp16 keeps the module itself in low
    precision). Under DeepSpeed every rank must call this (the master weights are sharded)."""
    net = accelerator.unwrap_model(model)
    state = {k: v.detach().float() for k, v in net.state_dict().items()}
    names = [name for name, _ in net.named_parameters()]
    if ema is not None:
        state.update(zip(names, ema.shadow_params))
    elif accelerator.distributed_type == DistributedType.DEEPSPEED:
        from deepspeed.utils import safe_get_full_fp32_param

        for name, param in net.named_parameters():
            full = safe_get_full_fp32_param(param)
            if full is None and param.dtype != torch.float32:
                raise RuntimeError(f"cannot recover fp32 master weights of {name} from DeepSpeed")
            state[name] = (param if full is None else full).detach().float()
    return state


def export_weights(accelerator: Accelerator, model: torch.nn.Module, ema: EMAModel | None, directory: Path,
                   stem: str, suffixes: tuple[str, ...] = (".pth", ".safetensors")) -> None:
    """Write fp32 published-format weights (call on every rank; the main process writes)."""
    state = fp32_weights(accelerator, model, ema)
    if accelerator.is_main_process:
        for suffix in suffixes:
            save_weights(accelerator.unwrap_model(model), directory / f"{stem}{suffix}", state)


def export_best_model(accelerator: Accelerator, model: torch.nn.Module, ema: EMAModel | None, run_dir: Path,
                      info: dict) -> None:
    """Atomically replace ``best_model/`` (weights + ``model_info.json``)."""
    def write(tmp: Path) -> None:
        export_weights(accelerator, model, ema, tmp, "weights")
        if accelerator.is_main_process:
            (tmp / "model_info.json").write_text(json.dumps(info, indent=1))

    write_atomically(accelerator, run_dir / "best_model", write, {"step": info["step"]})


def placeholder_batch(net: TAEHV, config: TrainConfig, device: torch.device,
                      with_reference: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A tiny clip (and reference latents) with the training shapes' frame count: the
    forward pass a rank runs when its own ran out of memory, so its backward pass joins
    the same gradient collectives as the other ranks."""
    size = 8 * net.patch_size
    frames = torch.zeros(1, config.n_frames, 3, size, size, device=device)
    if not with_reference:
        return frames, None
    latents = net.plan(config.n_frames).latent_frames
    return frames, torch.zeros(1, latents, net.latent_channels, 1, 1, device=device)


class Forward(NamedTuple):
    out: AutoencoderOutput
    targets: torch.Tensor  # input frames aligned with the decoded frames (FramePlan.target)
    losses: dict[str, torch.Tensor]


def training_forward(accelerator: Accelerator, model: torch.nn.Module, frames: torch.Tensor,
                     z_ref: torch.Tensor | None, config: TrainConfig, input_dtype: torch.dtype) -> Forward:
    """The model's forward pass and the recipe's losses; inputs are cast to the weights'
    dtype here, once (DeepSpeed bf16 keeps the module in bf16: the seeds' error 4)."""
    targets = accelerator.unwrap_model(model).plan(frames.shape[1]).target(frames)
    with accelerator.autocast():
        out = model(frames.to(input_dtype), None if z_ref is None else z_ref.to(input_dtype),
                    decode_own=z_ref is None or config.reconstruction_loss_weight > 0)
    losses = compute_losses(out, targets, z_ref, config.encoder_loss_weight, config.decoder_loss_weight,
                            config.reconstruction_loss_weight, config.lpips_loss_weight)
    return Forward(out, targets, losses)


def add_seraena_loss(forward: Forward, seraena: Seraena, z_ref: torch.Tensor | None, config: TrainConfig) -> None:
    """Seraena on the frames the decoder makes from the reference latents (its own
    latents without a reference VAE), with those latents as context."""
    out, losses = forward.out, forward.losses
    decoded, latents = (out.decoded_from_reference, z_ref) if z_ref is not None else (out.decoded, out.latents)
    loss, stats = seraena_loss(seraena, decoded, forward.targets, latents, config.n_seraena_frames)
    losses["seraena_loss"] = loss
    losses["seraena_disc_loss"] = stats["disc_loss"].detach()
    losses["loss"] = losses["loss"] + config.seraena_loss_weight * loss


def main(argv: list[str] | None = None) -> Path:
    config = parse_args(argv)
    notes = check(config)
    faults = FaultPlan.parse(config.fault_injection)
    run_dir, resume_from = decide_run_dir(process_state(), config)
    accelerator = make_accelerator(config, run_dir)
    setup_logging(run_dir, accelerator)
    for note in notes:
        logger.info(note)
    logger.info("run directory %s; %d process(es), %s, mixed precision %s", run_dir, accelerator.num_processes,
                accelerator.distributed_type, config.mixed_precision)
    checkpoints = run_dir / "checkpoints"
    if accelerator.is_main_process:
        (run_dir / "config.json").write_text(describe(config))
        remove_partial_checkpoints(checkpoints)
    set_seed(config.seed)  # identical initial weights on every rank
    torch.autograd.set_detect_anomaly(config.detect_anomaly)

    model = build_model(config)
    ref_vae = None
    if config.ref_vae_path:
        ref_vae = ReferenceVAE(resolve_path(config.ref_vae_path), config.ref_vae_class, config.ref_vae_subfolder,
                               config.ref_vae_dtype, accelerator.device, config.ref_latent_sample)
        if ref_vae.latent_channels != model.latent_channels:
            raise ConfigError(f"the reference VAE has {ref_vae.latent_channels} latent channels but {config.variant} "
                              f"has {model.latent_channels}: pick the matching variant")

    train_set, val_set = build_datasets(config)
    report = train_set.validate()
    logger.info("training clips: %d (%s)", len(train_set), report)
    if config.latent_cache_dir:  # reference latents precomputed for these clips and crops
        train_set = CachedLatentDataset.from_config(train_set, config)
        logger.info("reference latents from the cache %s (%d epochs)", config.latent_cache_dir,
                    train_set.cache.epochs)
    loader = build_dataloader(train_set, config.train_batch_size, config.dataloader_num_workers, shuffle=True,
                              seed=config.seed, drop_last=True, prefetch_factor=config.prefetch_factor,
                              persistent_workers=config.persistent_workers, pin_memory=accelerator.device.type == "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate,
                                  betas=(config.adam_beta1, config.adam_beta2), weight_decay=config.weight_decay)
    scheduler = get_scheduler(config.lr_scheduler, optimizer, num_warmup_steps=config.lr_warmup_steps * accelerator.num_processes,
                              num_training_steps=config.max_train_steps * accelerator.num_processes)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    net: TAEHV = accelerator.unwrap_model(model)
    # fp32 shadow weights even when DeepSpeed keeps the model itself in bf16/fp16
    ema = EMAModel([p.detach().float() for p in net.parameters()], decay=config.ema_decay) if config.use_ema else None
    if ema is not None:
        ema.to(accelerator.device)
    generator = torch.Generator(accelerator.device).manual_seed(config.seed * 1000 + accelerator.process_index)
    seraena = build_seraena(config, net, accelerator.device) if config.use_seraena else None
    objects = TrainingObjects(accelerator, model, optimizer, scheduler, ema, generator,
                              {"seraena": seraena} if seraena is not None else {})

    progress = Progress()
    tracker = BestTracker(config.best_metric, config.early_stopping_patience, config.early_stopping_min_delta)
    if resume_from is not None:
        saved = load_training_state(objects, resume_from)
        progress = Progress(**saved["progress"])
        tracker = BestTracker.replay(saved["validation_history"], config.best_metric,
                                     config.early_stopping_patience, config.early_stopping_min_delta)
        logger.info("resumed from %s at step %d (epoch %d, batch %d)", resume_from, progress.step, progress.epoch,
                    progress.batch_in_epoch)
    monitor = Monitor(accelerator, config, run_dir, progress.step)

    def checkpoint() -> Path:
        trainer_state = {"progress": asdict(progress), "validation_history": tracker.history, "config": config.to_dict()}
        return save_checkpoint(
            objects, checkpoints, progress.step, config.checkpoints_total_limit, trainer_state,
            export=lambda d: export_weights(accelerator, model, ema, d, "weights", (".safetensors",)),
            before_commit=lambda: faults.maybe_crash_in_save(progress.step, accelerator.process_index))

    input_dtype = next(net.parameters()).dtype  # DeepSpeed bf16/fp16 casts the weights themselves
    samples_per_step = config.train_batch_size * config.gradient_accumulation_steps * accelerator.num_processes

    def after_step(grad_norm) -> str | None:
        """Logging, validation (best model, early stopping) and checkpointing after an
        applied step; returns why training stops now, or None."""
        step, last = progress.step, progress.step >= config.max_train_steps
        if step % config.log_every == 0 or last:
            logs = monitor.log_train(step, scheduler.get_last_lr()[0], grad_norm, samples_per_step)
            progress_bar.set_postfix(loss=f"{logs['train/loss']:.4f}", psnr=f"{monitor.last_psnr:.2f}")
        early_stop = False
        if val_set is not None and (step % config.validation_every == 0 or last):
            with ema_weights(ema, net):
                metrics = validate(accelerator, net, val_set, config, ref_vae, input_dtype)
            monitor.log_validation(step, metrics)
            model.train()
            scalars = {k: v for k, v in metrics.items() if isinstance(v, float)}
            if tracker.update(step, scalars):
                export_best_model(accelerator, model, ema, run_dir, {
                    "step": step, "metric": config.best_metric, "value": scalars[config.best_metric],
                    "metrics": scalars, "variant": net.variant, "ema": ema is not None, "config_file": config.config_file})
                logger.info("new best %s=%.4f at step %d: saved %s", config.best_metric, scalars[config.best_metric],
                            step, run_dir / "best_model")
            if accelerator.is_main_process:
                tracker.write_history(run_dir)
            early_stop = broadcast_flag(tracker.should_stop, accelerator.device)  # decided once, obeyed by all
        if step % config.checkpointing_steps == 0 or last:
            checkpoint()
        if last:
            return "finished"
        return "early_stop" if early_stop else None

    progress_bar = tqdm(total=config.max_train_steps, initial=progress.step, disable=not accelerator.is_local_main_process,
                        desc="train", dynamic_ncols=True)
    profiler = monitor.profiler()
    stop = StopRequest().install()
    stop_reason = "finished" if progress.step >= config.max_train_steps else None
    window_problem = None  # why the current accumulation window must be skipped
    model.train()
    while stop_reason is None:
        loader.set_epoch(progress.epoch)  # the sampler's permutation and the dataset's draws follow the epoch
        epoch_loader = accelerator.skip_first_batches(loader, progress.batch_in_epoch) if progress.batch_in_epoch else loader
        for batch in epoch_loader:
            progress.batch_in_epoch += 1
            rank, window = accelerator.process_index, progress.step + progress.skipped_steps + 1
            faults.maybe_signal(window, rank)
            with accelerator.accumulate(model):
                losses, out_of_memory = None, False
                try:
                    frames = batch["frames"].to(accelerator.device, non_blocking=True).float().div_(255)
                    if "latents" in batch:
                        z_ref = batch["latents"].to(accelerator.device, non_blocking=True).float()
                    else:
                        z_ref = ref_vae.encode(frames, generator) if ref_vae is not None else None
                    forward = training_forward(accelerator, model, frames, z_ref, config, input_dtype)
                    losses = forward.losses
                    losses["loss"] = faults.inject_forward(window, rank, losses["loss"])
                except torch.OutOfMemoryError as err:
                    logger.error("out of memory in the forward pass of step %d: %s", progress.step + 1, err)
                    out_of_memory = True
                if out_of_memory and torch.cuda.is_available():
                    torch.cuda.empty_cache()  # outside the except block, whose traceback holds the activations
                local_nonfinite = losses is not None and not bool(torch.isfinite(losses["loss"]))
                any_oom, any_nonfinite, any_signal = agree([out_of_memory, local_nonfinite, stop.requested],
                                                           accelerator.device)
                if any_oom or any_nonfinite:
                    window_problem = "out of memory" if any_oom else "non-finite loss"
                    if losses is None:
                        losses = training_forward(accelerator, model, *placeholder_batch(
                            net, config, accelerator.device, ref_vae is not None), config, input_dtype).losses
                    accelerator.backward(poisoned(losses["loss"]))
                else:
                    if seraena is not None:  # after the agreement: every rank takes the discriminator step
                        add_seraena_loss(forward, seraena, z_ref, config)
                    accelerator.backward(losses["loss"])
                    monitor.accumulate(losses)
                grad_norm = None
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm or math.inf)
                    applied = window_problem is None and is_finite_number(grad_norm)
                    if applied:
                        optimizer.step()
                        scheduler.step()
                    elif accelerator.scaler is not None:
                        accelerator.scaler.update()  # fp16: lower the loss scale as the scaler's own skip would
                    optimizer.zero_grad(set_to_none=True)
            monitor.count_failures(batch["failures"])
            if not accelerator.sync_gradients:
                continue

            if applied:
                progress.step += 1
                progress.consecutive_skips = 0
                if ema is not None:
                    ema.step(net.parameters())
                if profiler is not None:
                    profiler.step()
                progress_bar.update(1)
                stop_reason = after_step(grad_norm)
            else:
                progress.skipped_steps += 1
                progress.consecutive_skips += 1
                logger.warning("step %d skipped on every rank: %s (%d in a row, %d in total)", progress.step + 1,
                               window_problem or "non-finite gradient", progress.consecutive_skips,
                               progress.skipped_steps)
                monitor.log_skipped(progress.step, progress.skipped_steps)
                if progress.consecutive_skips >= config.max_consecutive_skipped_steps:
                    stop_reason = "skipped"
            window_problem = None
            if any_signal and stop_reason is None:
                stop_reason = "signal"
            if stop_reason is not None:
                break
        else:
            progress.epoch += 1
            progress.batch_in_epoch = 0

    if profiler is not None:
        profiler.stop()
    progress_bar.close()
    stop.uninstall()
    if stop_reason in ("signal", "skipped"):
        path = checkpoint()
        accelerator.end_training()
        if stop_reason == "skipped":
            raise TrainingAborted(
                f"{progress.consecutive_skips} steps in a row were skipped (non-finite loss or gradient, or out of "
                f"memory); saved {path}. Lower learning_rate, enable max_grad_norm, use bf16 instead of fp16, or "
                "check the data and the reference VAE, then resume with --resume latest")
        logger.info("stopped on %s at step %d; saved %s. Resume with --resume latest (or --auto_resume=true)",
                    stop.signal_name or "a signal received by another rank", progress.step, path)
        return run_dir
    if stop_reason == "early_stop":
        logger.info("early stopping at step %d: %s did not improve for %d validations (best %.4f at step %s)",
                    progress.step, config.best_metric, tracker.bad_validations, tracker.best_value, tracker.best_step)
        checkpoint()
    export_weights(accelerator, model, ema, run_dir, "final_model")
    if accelerator.is_main_process:
        logger.info("saved %s and %s", run_dir / "final_model.pth", run_dir / "final_model.safetensors")
    accelerator.end_training()
    return run_dir


@contextlib.contextmanager
def ema_weights(ema: EMAModel | None, model: torch.nn.Module):
    """Temporarily swap in the EMA weights (what gets exported) for validation."""
    if ema is None:
        yield
        return
    ema.store(model.parameters())
    ema.copy_to(model.parameters())
    try:
        yield
    finally:
        ema.restore(model.parameters())


def entry_point() -> None:
    try:
        exit_on_config_error(main)
    except TrainingAborted as err:
        logger.error("%s", err)
        sys.exit(1)


if __name__ == "__main__":
    entry_point()
