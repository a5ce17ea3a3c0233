"""The training step: everything from a batch to the optimizer step, in one object.

    step = TrainStep.build(config, accelerator, model, data.latents, faults, stop)
    step, loader = TrainStep.build(..., loader=loader)   # the loader is prepared with the model
    result = step(batch, window)                           # one micro-batch

A call normalises the frames, gets the reference latents from the one source the data
module chose (cache, frozen VAE or none), runs the model's forward pass and the recipe's
losses on frames aligned by the model's FramePlan, adds Seraena's loss, and runs the
backward pass; at the end of an accumulation window it clips the gradients and steps the
optimizer, the scheduler and the EMA weights, or skips the window on every rank.

Skipping is decided together (``training.loop.resilience``): each rank contributes whether its
forward pass ran out of memory, whether its loss is non-finite and whether a signal
arrived, in one all-reduce. A rank whose forward pass failed runs a placeholder clip so
that its backward pass joins the same gradient collectives, every rank back-propagates a
NaN-poisoned loss, and the non-finite gradient norm makes every rank skip the optimizer
step. Logging, validation and checkpoint cadence are the loop's business, not the step's.
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
from accelerate import Accelerator
from diffusers.training_utils import EMAModel
from torch.utils.data import DataLoader

from models.seraena import Seraena
from models.taehv import TAEHV, AutoencoderOutput
from training.config import TrainConfig
from training.data.clips import VideoDataError, frames_to_unit
from training.data.loading import ReferenceLatents
from training.loop.adversarial import build_seraena, seraena_loss
from training.loop.losses import compute_losses
from training.loop.optimisation import LearningRateSchedule
from training.loop.resilience import FaultPlan, StopRequest, agree, is_finite_number, poisoned
from training.state.checkpoints import TrainingObjects

logger = logging.getLogger(__name__)


def build_model(config: TrainConfig, resumed: bool = False) -> TAEHV:
    """The model to train: published or our weights, or a fresh one whose decoder starts
    from mid-grey frames (``decoder_bias_init``); a resumed run's weights then come from
    its checkpoint. With ``train_encoder=False`` the encoder is frozen as loaded (also on
    resume: its fp32 weights are the ones exported)."""
    if config.pretrained_model_path and (not resumed or not config.train_encoder):
        model = TAEHV(config.pretrained_model_path, variant=config.variant)
        logger.info("initialised from %s", config.pretrained_model_path)
    else:
        model = TAEHV(variant=config.variant)
        with torch.no_grad():
            model.decoder[-1].bias.fill_(config.decoder_bias_init)
        if not resumed:
            logger.info("training %s from scratch", config.variant)
    if not config.train_encoder:
        model.encoder.requires_grad_(False)
        logger.info("decoder-only: the encoder is frozen (no gradients, no optimizer state)")
    return model


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


class StepResult(NamedTuple):
    """What one micro-batch did."""

    window_done: bool  # it ended an accumulation window (the optimizer was stepped or skipped)
    applied: bool  # the window's optimizer step was taken, on every rank
    skip_reason: str | None  # why the window was skipped on every rank (window_done and not applied)
    losses: dict[str, torch.Tensor] | None  # its loss terms; None when its window is being skipped
    grad_norm: torch.Tensor | float | None  # the window's gradient norm (at window_done)
    stop_requested: bool  # SIGTERM/SIGINT arrived on some rank: stop at this step boundary
    data_failed: bool = False  # some rank could not load its batch: every rank stops now, without a backward pass


class TrainStep:
    """Owns the model, optimizer, scheduler, EMA weights, Seraena and the source of
    reference latents; ``step(batch, window)`` trains on one micro-batch."""

    def __init__(self, config: TrainConfig, accelerator: Accelerator, model: torch.nn.Module, optimizer, scheduler,
                 latents: ReferenceLatents, faults: FaultPlan, stop: StopRequest,
                 frozen: dict[str, torch.Tensor] | None = None):
        self.config, self.accelerator = config, accelerator
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.latents, self.faults, self.stop = latents, faults, stop
        self.net: TAEHV = accelerator.unwrap_model(model)
        self.trainable = [p for p in self.net.parameters() if p.requires_grad]  # all but a frozen encoder
        # fp32 shadow weights even when DeepSpeed keeps the model itself in bf16/fp16
        self.ema = (EMAModel([p.detach().float() for p in self.trainable], decay=config.ema_decay)
                    if config.use_ema else None)
        if self.ema is not None:
            self.ema.to(accelerator.device)
        # per-rank stream for sampling reference latents (latent_dist.sample)
        self.generator = torch.Generator(accelerator.device).manual_seed(config.seed * 1000 + accelerator.process_index)
        # kept out of accelerator.prepare: it synchronises itself across ranks (models/seraena.py)
        self.seraena: Seraena | None = build_seraena(config, self.net, accelerator.device) if config.use_seraena else None
        self.objects = TrainingObjects(accelerator, model, optimizer, scheduler, self.ema, self.generator,
                                       {"seraena": self.seraena} if self.seraena is not None else {}, frozen)
        self.input_dtype = next(self.net.parameters()).dtype  # DeepSpeed bf16/fp16 casts the weights themselves
        self._window_problem: str | None = None  # why the current accumulation window must be skipped

    @classmethod
    def build(cls, config: TrainConfig, accelerator: Accelerator, model: TAEHV, latents: ReferenceLatents,
              faults: FaultPlan | None = None, stop: StopRequest | None = None,
              loader: DataLoader | None = None) -> tuple[TrainStep, DataLoader | None]:
        """AdamW and the LR schedule for ``model``, prepared by Accelerate together with the
        training ``loader`` (DeepSpeed reads its batch size from it); returns the step and
        the prepared loader."""
        # the frozen weights as loaded, in fp32 (DeepSpeed casts the module): what exports keep of them
        frozen = {name: p.detach().to("cpu", torch.float32, copy=True) for name, p in model.named_parameters()
                  if not p.requires_grad}
        # fused: one kernel for all parameters (5x faster than foreach on CPU at 11M parameters)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate,
                                      betas=(config.adam_beta1, config.adam_beta2),
                                      weight_decay=config.weight_decay, fused=True)
        processes = accelerator.num_processes  # a prepared scheduler steps once per process
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, LearningRateSchedule(
            config.lr_scheduler, config.lr_warmup_steps * processes, config.max_train_steps * processes))
        if config.compile:  # before prepare: wrappers (DDP, DeepSpeed) call forward, which runs the compiled chunks
            model.compile(backend=config.compile_backend)
            logger.info("torch.compile (backend %s): the first steps and the first validation pay compilation",
                        config.compile_backend)
        if loader is None:
            model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        else:
            model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        step = cls(config, accelerator, model, optimizer, scheduler, latents, faults or FaultPlan(), stop or StopRequest(),
                   frozen)
        return step, loader

    def __call__(self, batch: dict | VideoDataError, window: int) -> StepResult:
        """Train on one micro-batch of accumulation window ``window`` (counted from 1,
        skipped windows included). ``batch`` is the VideoDataError instead when this rank
        could not load its batch (the data went away: ``batches_until_data_error``)."""
        acc, rank = self.accelerator, self.accelerator.process_index
        self.faults.maybe_signal(window, rank)
        data_failed = isinstance(batch, VideoDataError)
        with acc.accumulate(self.model):
            forward, z_ref, losses, out_of_memory = None, None, None, False
            try:
                if not data_failed:
                    frames = frames_to_unit(batch["frames"], acc.device)
                    z_ref = self.latents(batch, frames, self.generator)
                    forward = self.forward(frames, z_ref)
                    losses = forward.losses
                    losses["loss"] = self.faults.inject_forward(window, rank, losses["loss"])
            except torch.OutOfMemoryError as err:
                logger.error("out of memory in the forward pass of window %d: %s", window, err)
                out_of_memory = True
            if out_of_memory and torch.cuda.is_available():
                torch.cuda.empty_cache()  # outside the except block, whose traceback holds the activations
            local_nonfinite = losses is not None and not bool(torch.isfinite(losses["loss"]))
            any_oom, any_nonfinite, any_signal, any_data_failed = agree(
                [out_of_memory, local_nonfinite, self.stop.requested, data_failed], acc.device)
            if any_data_failed:  # no rank runs a backward pass, so no rank waits in its collectives
                self._window_problem = None
                return StepResult(False, False, None, None, None, any_signal, data_failed=True)
            if any_oom or any_nonfinite:
                self._window_problem = "out of memory" if any_oom else "non-finite loss"
                if losses is None:
                    losses = self.forward(*self.placeholder_batch()).losses
                acc.backward(poisoned(losses["loss"]))
                losses = None
            else:
                if self.seraena is not None:  # after the agreement: every rank takes the discriminator step
                    self.add_seraena_loss(forward, z_ref)
                acc.backward(losses["loss"])
            grad_norm, applied = None, False
            if acc.sync_gradients:
                grad_norm = acc.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm or math.inf)
                applied = self._window_problem is None and is_finite_number(grad_norm)
                if applied:
                    self.optimizer.step()
                    self.scheduler.step()
                elif acc.scaler is not None:
                    acc.scaler.update()  # fp16: lower the loss scale as the scaler's own skip would
                self.optimizer.zero_grad(set_to_none=True)
        skip_reason = None
        if acc.sync_gradients:
            if applied and self.ema is not None:
                self.ema.step(self.trainable)
            if not applied:
                skip_reason = self._window_problem or "non-finite gradient"
            self._window_problem = None
        return StepResult(acc.sync_gradients, applied, skip_reason, losses, grad_norm, any_signal)

    @property
    def schedule(self) -> LearningRateSchedule:
        """The learning-rate schedule (a time budget sets its horizon once the run's speed is known)."""
        return getattr(self.scheduler, "scheduler", self.scheduler).lr_lambdas[0]

    def forward(self, frames: torch.Tensor, z_ref: torch.Tensor | None) -> Forward:
        return training_forward(self.accelerator, self.model, frames, z_ref, self.config, self.input_dtype)

    def add_seraena_loss(self, forward: Forward, z_ref: torch.Tensor | None) -> None:
        """Seraena on the frames the decoder makes from the reference latents (its own
        latents without them), with those latents as context."""
        out, losses = forward.out, forward.losses
        decoded, latents = (out.decoded_from_reference, z_ref) if z_ref is not None else (out.decoded, out.latents)
        loss, stats = seraena_loss(self.seraena, decoded, forward.targets, latents, self.config.n_seraena_frames)
        losses["seraena_loss"] = loss
        losses["seraena_disc_loss"] = stats["disc_loss"].detach()
        losses["loss"] = losses["loss"] + self.config.seraena_loss_weight * loss

    def placeholder_batch(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A tiny clip (and reference latents) with the training frame count: the forward
        pass a rank runs when its own ran out of memory, so its backward pass joins the same
        gradient collectives as the other ranks."""
        device, size = self.accelerator.device, 8 * self.net.patch_size
        frames = torch.zeros(1, self.config.n_frames, self.net.image_channels, size, size, device=device)
        if not self.latents.available:
            return frames, None
        latents = self.net.plan(self.config.n_frames).latent_frames
        return frames, torch.zeros(1, latents, self.net.latent_channels, 1, 1, device=device)

    @contextlib.contextmanager
    def averaged_weights(self) -> Iterator[None]:
        """Temporarily swap in the EMA weights (what gets exported), e.g. for validation."""
        if self.ema is None:
            yield
            return
        self.ema.store(self.trainable)
        self.ema.copy_to(self.trainable)
        try:
            yield
        finally:
            self.ema.restore(self.trainable)
