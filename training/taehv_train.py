#!/usr/bin/env python3
"""Train or fine-tune a TAEHV in a reference VAE's latent space.

    accelerate launch --config_file accelerate_configs/deepspeed_8gpu.yaml \
        training/taehv_train.py --config training/configs/taehv_config_h100.py [--key=value ...]
    python training/taehv_train.py --config training/configs/taehv_config_demo.py   # one process

One readable loop under Accelerate (1 process, DDP or DeepSpeed ZeRO-2; gloo on CPU):
reference latents from the frozen VAE, the model called through ``forward``, losses on
frames aligned by the model's FramePlan, EMA weights, TensorBoard, periodic checkpoints
and a final fp32 export in the published key format.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from accelerate import Accelerator, PartialState  # noqa: E402
from accelerate.utils import InitProcessGroupKwargs, set_seed  # noqa: E402
from diffusers.optimization import get_scheduler  # noqa: E402
from diffusers.training_utils import EMAModel  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from models.checkpoint import save_weights  # noqa: E402
from models.taehv import TAEHV  # noqa: E402
from training.checkpointing import checkpoint_step, new_run_dir, resolve_resume, save_checkpoint  # noqa: E402
from training.config import ConfigError, TrainConfig, check, describe, exit_on_config_error, load_config, resolve_path  # noqa: E402
from training.dataset import VideoClipDataset, build_dataloader  # noqa: E402
from training.losses import compute_losses  # noqa: E402
from training.monitoring import Monitor  # noqa: E402
from training.utils import ReferenceVAE  # noqa: E402
from training.validation import validate  # noqa: E402

logger = logging.getLogger("taehv_train")


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    parser = argparse.ArgumentParser(description="Train a TAEHV (see README).", allow_abbrev=False)
    parser.add_argument("--config", required=True, help="Python config file defining `config`")
    parser.add_argument("--resume", default=None, help="shorthand for --resume_from_checkpoint")
    args, overrides = parser.parse_known_args(argv)
    if args.resume:
        overrides.append(f"--resume_from_checkpoint={args.resume}")
    return load_config(args.config, overrides)


def process_group_backend() -> str | None:
    """gloo for multi-process runs without CUDA (NCCL needs GPUs); Accelerate's default otherwise."""
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return "gloo" if distributed and not torch.cuda.is_available() else None


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


def export_weights(model: TAEHV, ema: EMAModel | None, directory: Path, stem: str,
                   suffixes: tuple[str, ...] = (".pth", ".safetensors")) -> None:
    """fp32 weights in the published key format (the EMA weights when kept)."""
    state_dict = None
    if ema is not None:
        names = [name for name, _ in model.named_parameters()]
        state_dict = dict(model.state_dict())
        state_dict.update({name: p for name, p in zip(names, ema.shadow_params)})
    for suffix in suffixes:
        save_weights(model, directory / f"{stem}{suffix}", state_dict)


def main(argv: list[str] | None = None) -> Path:
    config = parse_args(argv)
    notes = check(config)
    backend = process_group_backend()
    cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")  # DDP over CPU processes
    run_dir, resume_from = decide_run_dir(PartialState(cpu=cpu, **({"backend": backend} if backend else {})), config)
    accelerator = make_accelerator(config, run_dir)
    setup_logging(run_dir, accelerator)
    for note in notes:
        logger.info(note)
    logger.info("run directory %s; %d process(es), %s, mixed precision %s", run_dir, accelerator.num_processes,
                accelerator.distributed_type, config.mixed_precision)
    if accelerator.is_main_process:
        (run_dir / "config.json").write_text(describe(config))
    set_seed(config.seed)  # identical initial weights on every rank
    torch.autograd.set_detect_anomaly(config.detect_anomaly)

    model = build_model(config)
    plan = model.plan(config.n_frames)
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
    loader = build_dataloader(train_set, config.train_batch_size, config.dataloader_num_workers, shuffle=True,
                              seed=config.seed, drop_last=True, prefetch_factor=config.prefetch_factor,
                              persistent_workers=config.persistent_workers)
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
        accelerator.register_for_checkpointing(ema)

    checkpoints = run_dir / "checkpoints"
    global_step = 0
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        global_step = checkpoint_step(resume_from)
        logger.info("resumed from %s at step %d", resume_from, global_step)
    monitor = Monitor(accelerator, config, run_dir, global_step)

    input_dtype = next(net.parameters()).dtype  # DeepSpeed bf16/fp16 casts the weights themselves
    generator = torch.Generator(accelerator.device).manual_seed(config.seed * 1000 + accelerator.process_index)
    samples_per_step = config.train_batch_size * config.gradient_accumulation_steps * accelerator.num_processes
    progress = tqdm(total=config.max_train_steps, initial=global_step, disable=not accelerator.is_local_main_process,
                    desc="train", dynamic_ncols=True)
    profiler = monitor.profiler()
    epoch = global_step * config.gradient_accumulation_steps // max(len(loader), 1)
    model.train()
    while global_step < config.max_train_steps:
        train_set.set_epoch(epoch)
        for batch in loader:
            with accelerator.accumulate(model):
                frames = batch["frames"].to(accelerator.device, non_blocking=True).float().div_(255)
                targets = plan.target(frames)
                z_ref = ref_vae.encode(frames, generator) if ref_vae is not None else None
                with accelerator.autocast():
                    out = model(frames.to(input_dtype), None if z_ref is None else z_ref.to(input_dtype),
                                decode_own=z_ref is None or config.reconstruction_loss_weight > 0)
                losses = compute_losses(out, targets, z_ref, config.encoder_loss_weight, config.decoder_loss_weight,
                                        config.reconstruction_loss_weight, config.lpips_loss_weight)
                accelerator.backward(losses["loss"])
                grad_norm = None
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm or math.inf)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            monitor.accumulate(losses, batch["failures"])
            if not accelerator.sync_gradients:
                continue
            global_step += 1
            if ema is not None:
                ema.step(net.parameters())
            if profiler is not None:
                profiler.step()
            progress.update(1)
            if global_step % config.log_every == 0 or global_step == config.max_train_steps:
                logs = monitor.log_train(global_step, scheduler.get_last_lr()[0], grad_norm, samples_per_step)
                progress.set_postfix(loss=f"{logs['train/loss']:.4f}", psnr=f"{monitor.last_psnr:.2f}")
            if val_set is not None and (global_step % config.validation_every == 0 or global_step == config.max_train_steps):
                with ema_weights(ema, net):
                    metrics = validate(accelerator, net, val_set, config, ref_vae, input_dtype)
                monitor.log_validation(global_step, metrics)
                model.train()
            if global_step % config.checkpointing_steps == 0 or global_step == config.max_train_steps:
                save_checkpoint(accelerator, checkpoints, global_step, config.checkpoints_total_limit,
                                export=lambda d: export_weights(net, ema, d, "weights", (".safetensors",)))
            if global_step >= config.max_train_steps:
                break
        epoch += 1

    if profiler is not None:
        profiler.stop()
    progress.close()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        export_weights(net, ema, run_dir, "final_model")
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


if __name__ == "__main__":
    exit_on_config_error(main)
