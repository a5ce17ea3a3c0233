"""The training step: one accumulation window, from its micro-batches to the optimizer step, in one object.

    train_step = TrainStep.build(config, accelerator, model, data.latents, faults, stop)
    train_step, loader = TrainStep.build(..., loader=loader)   # the loader is prepared with the model
    result = train_step(batches, window)                       # one accumulation window

A call takes the window's micro-batches from ``batches``. For each it normalises the
frames, gets the reference latents from the one source the data module chose (cache,
frozen VAE or none), runs the model's forward pass and the recipe's losses on frames
aligned by the model's FramePlan, adds Seraena's loss, takes this rank's gradients and
hands them to the optimizer; at the end of the window it clips the gradients and steps
the optimizer, the scheduler and the EMA weights, or skips the window on every rank. It
returns what the loop counts and logs.

Skipping is decided together (``training.loop.resilience``), once per window. The
gradients are taken with ``torch.autograd.grad``, which no distributed hook sees, and then
handed over in a backward pass of ``sum(p * g)`` that DDP's and ZeRO's hooks do see: an
error anywhere in the real backward pass (out of memory, a compilation that fails) happens
before any collective, and a rank with nothing to hand over (such an error, out of memory
in the forward pass or the copy to the GPU, lost data) hands over NaN gradients through the
same collectives as the other ranks. What a micro-batch ran into stays where it was found
(non-finite losses and gradients as device flags, the rest on the host) until the window's
end, where every rank's flags and the stop signal are agreed in one all-reduce and read
once. Under DeepSpeed the step drives the engine (``training.loop.deepspeed_engine``): its
optimizer step comes after that agreement, and a skipped window is dropped by it.

Reads from the device: the step's own is that one per window. DeepSpeed's step adds its
own: three per optimizer step under ZeRO-2 in bf16 (DeepSpeed 0.19.8: its overflow check's
agreed flag, and twice whether the gradient norm it clips by is finite); a torch.compile'd
model adds none. Logging, validation and checkpoint cadence are the loop's business, not the step's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from taehv_train.common.clips import VideoDataError, frames_to_unit
from taehv_train.common.config import TrainConfig
from taehv_train.models.seraena import Seraena
from taehv_train.models.taehv import TAEHV
from taehv_train.training.data.cuda_sequence import IdleClock
from taehv_train.training.data.loading import ReferenceLatents
from taehv_train.training.data.prefetch import BatchOutOfMemory, Fetched, WaitInterrupted
from taehv_train.training.loop import deepspeed_engine, library_seams
from taehv_train.training.loop.adversarial import build_seraena, seraena_loss
from taehv_train.training.loop.forward import Forward, frozen_weights, training_forward
from taehv_train.training.loop.optimisation import LearningRateSchedule, compiles, make_optimizer
from taehv_train.training.loop.resilience import (
    FaultPlan,
    Settled,
    StopRequest,
    WindowTrouble,
    failing_backward_backend,
)
from taehv_train.training.state.checkpoints import TrainingObjects
from taehv_train.training.state.trained_weights import make_ema

logger = logging.getLogger(__name__)


NO_SCALE = 1.0  # the loss scale of bf16 and fp32 training: nothing to multiply or divide
# what the loop says with a window skipped for lack of memory, and when the optimizer step ran out
OUT_OF_MEMORY_ADVICE = (
    "lower train_batch_size (raising gradient_accumulation_steps keeps the batch), n_frames, or height/width"
)


class OptimizerStepFailed(RuntimeError):
    """The optimizer step itself ran out of memory: the weights and the optimizer state may
    be half-updated, so nothing after the last checkpoint can be saved."""


def free_cached_memory() -> None:
    """Give the CUDA caching allocator's free blocks back after an out-of-memory error."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class StepResult(NamedTuple):
    """What one accumulation window did: what the loop counts and logs."""

    applied: bool  # the window's optimizer step was taken, on every rank
    skip_reason: str | None  # why the window was skipped on every rank (not applied, data intact)
    losses: list[dict[str, torch.Tensor]]  # the detached loss terms of its micro-batches; none when skipped
    grad_norm: torch.Tensor | float | None  # the window's gradient norm (None when the data failed)
    stop_requested: bool  # SIGTERM/SIGINT arrived on some rank: stop at this step boundary
    micro_batches: int  # how many micro-batches the window took from ``batches`` (a failed one included)
    data_wait: float  # seconds this rank waited for them
    failures: torch.Tensor  # clips the dataset had to replace in them (bad files)
    data_failed: bool = False  # some rank could not load its batch: the window was dropped on every rank
    data_error: VideoDataError | WaitInterrupted | None = None  # why, when it was this rank's batch


class TrainStep:
    """Owns the model, optimizer, scheduler, EMA weights, Seraena and the source of
    reference latents; ``train_step(batches, window)`` trains one accumulation window."""

    def __init__(
        self,
        config: TrainConfig,
        accelerator: Accelerator,
        model: torch.nn.Module,
        optimizer,
        scheduler,
        latents: ReferenceLatents,
        faults: FaultPlan,
        stop: StopRequest,
        frozen: dict[str, torch.Tensor] | None = None,
    ):
        if library_seams.syncs_with_dataloader(accelerator) and config.gradient_accumulation_steps > 1:
            raise ValueError(
                "TrainStep ends its windows: build the Accelerator with accelerator.accumulation_plugin(config)"
            )
        self.config, self.accelerator = config, accelerator
        self.model = model  # as Accelerate prepared it (a DDP or DeepSpeed wrapper): what trains
        self.optimizer, self.scheduler = optimizer, scheduler
        self.latents, self.faults, self.stop = latents, faults, stop
        # the TAEHV itself: its methods and sizes
        self.unwrapped_model: TAEHV = library_seams.unwrapped_model(accelerator, model)
        self.trainable = [p for p in self.unwrapped_model.parameters() if p.requires_grad]  # all but a frozen encoder
        # DeepSpeed's engine is driven by the step (deepspeed_engine); its forward would hook the
        # outputs' gradients, which the step takes itself: the module runs as it is (ZeRO-1/2 keep it whole)
        self.engine = deepspeed_engine.engine_of(accelerator)
        self.forward_module = self.unwrapped_model if self.engine is not None else model
        # fp32 shadow weights even when DeepSpeed keeps the model itself in bf16/fp16
        self.ema = make_ema(self.trainable, config.ema_decay) if config.use_ema else None
        if self.ema is not None:
            self.ema.to(accelerator.device)
        # per-rank stream for sampling reference latents (latent_dist.sample)
        self.generator = torch.Generator(accelerator.device).manual_seed(config.seed * 1000 + accelerator.process_index)
        # kept out of accelerator.prepare: it synchronises itself across ranks (models/seraena.py)
        self.seraena: Seraena | None = (
            build_seraena(config, self.unwrapped_model, accelerator.device) if config.use_seraena else None
        )
        self.objects = TrainingObjects(
            accelerator,
            model,
            optimizer,
            scheduler,
            self.ema,
            self.generator,
            {"seraena": self.seraena} if self.seraena is not None else {},
            frozen,
        )
        self.idle = IdleClock(accelerator.device)  # what the monitor reports as train/gpu_idle
        # DeepSpeed bf16/fp16 casts the weights themselves
        self.input_dtype = next(self.unwrapped_model.parameters()).dtype

    @classmethod
    def build(
        cls,
        config: TrainConfig,
        accelerator: Accelerator,
        model: TAEHV,
        latents: ReferenceLatents,
        faults: FaultPlan | None = None,
        stop: StopRequest | None = None,
        loader: DataLoader | None = None,
    ) -> tuple[TrainStep, DataLoader | None]:
        """AdamW and the LR schedule for ``model``, prepared by Accelerate together with the
        training ``loader`` (DeepSpeed reads its batch size from it); returns the step and
        the prepared loader, whose batches stay on the host (``training.data.prefetch`` copies them)."""
        frozen = frozen_weights(model)
        optimizer, scheduler = make_optimizer(config, model, accelerator.num_processes)
        faults = faults or FaultPlan()
        if compiles(config):  # before prepare: wrappers (DDP, DeepSpeed) call forward, which runs the compiled chunks
            backend = config.compile_backend
            if faults.anywhere("compile_backward", accelerator.process_index):
                backend = failing_backward_backend()
            model.compile(backend=backend)
            logger.info(
                "torch.compile (backend %s): the first steps and the first validation pay compilation (compile=%s)",
                backend,
                config.compile,
            )
        deepspeed_engine.turn_on_overflow_check(accelerator)
        if loader is None:
            model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        else:
            model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
            # Its batches stay on the host (pinned on CUDA): the prefetching thread copies them to the device
            # (training.data.prefetch), where an out-of-memory copy costs a batch, not the loader's iterator.
            # Accelerate refuses per-object device_placement under DeepSpeed, so the placement is turned off here.
            library_seams.keep_batches_on_host(loader)
        if (engine := deepspeed_engine.engine_of(accelerator)) is not None:
            deepspeed_engine.check_engine(engine)
            if faults.anywhere("no_overflow_check", accelerator.process_index):
                deepspeed_engine.switch_off_overflow_check(engine)
        train_step = cls(
            config,
            accelerator,
            model,
            optimizer,
            scheduler,
            latents,
            faults,
            stop or StopRequest(),
            frozen,
        )
        return train_step, loader

    def __call__(self, batches: Iterator[Fetched | dict | VideoDataError], window: int) -> StepResult:
        """Train accumulation window ``window`` (counted from 1, skipped windows included) on
        micro-batches taken from ``batches``: ``gradient_accumulation_steps`` of them, or fewer
        when the epoch's last batch comes first (as Accelerate ends windows). The items are
        the prefetcher's (``training.data.prefetch``) or, for hand-made feeds (benchmarks,
        tests), plain batches (never the last of an epoch). A batch is the VideoDataError
        instead when this rank could not load it (the data went away, or none came within
        ``batch_timeout``), a WaitInterrupted when a stop came while this rank waited for it
        (the window is dropped on every rank, given back and the run saves), a
        BatchOutOfMemory when its copy to the GPU ran out of memory (skipped on every rank).

        The micro-batches are taken one at a time, as the window trains, and each wait for
        data is measured on its own. Nothing inside the window waits for the device: what a
        micro-batch runs into (a non-finite loss or gradient stays a device flag; an
        out-of-memory error, a failed compilation or lost data makes this rank hand over NaN
        gradients, so that every rank runs the same gradient collectives) is settled at the
        window's end, over all ranks, in one read (``WindowTrouble``; with Seraena also before
        each discriminator step, which every rank takes or skips together). A window whose
        data some rank lost is dropped on every rank with no optimizer step (the loop then
        saves the last step and stops). A SIGTERM/SIGINT is reported with the window's end
        (``stop_requested``), so the loop saves at a step boundary."""
        acc = self.accelerator
        trouble = WindowTrouble(acc.device)
        losses: list[dict[str, torch.Tensor]] = []
        failures, data_wait, taken = torch.zeros((), dtype=torch.long), 0.0, 0
        # this rank's data is gone, or a stop came while it waited: NaN gradients to the window's end
        data_error: VideoDataError | WaitInterrupted | None = None
        began = time.perf_counter()
        while True:
            started = time.perf_counter()
            self.idle.pause()  # the GPU finishes what is queued while the host waits
            item = next(batches, None)
            self.idle.resume()
            data_wait += time.perf_counter() - started
            if item is None:
                raise RuntimeError(f"the micro-batches ran out inside accumulation window {window}")
            item = item if isinstance(item, Fetched) else Fetched(item)
            taken += 1
            if data_error is None and isinstance(item.batch, (VideoDataError, WaitInterrupted)):
                data_error = item.batch
            batch = None if data_error is not None else item.batch
            if isinstance(batch, BatchOutOfMemory):  # its copy to the GPU: this micro-batch is skipped on every rank
                logger.error("%s", batch)
                trouble.out_of_memory, batch = True, None
            else:
                trouble.data_failed = trouble.data_failed or batch is None
            if batch is not None and "failures" in batch:  # hand-made batches (benchmarks, tests) have no count
                failures = failures + batch["failures"].sum()
            last = taken == self.config.gradient_accumulation_steps or item.last_in_epoch
            with self.accumulate(last):
                micro_losses = self.micro_batch(batch, window, trouble, last)
                if micro_losses is not None:
                    losses.append(micro_losses)
                if last:
                    self.faults.maybe_slow(window, acc.process_index, time.perf_counter() - began)
                    self.faults.maybe_signal(window, acc.process_index)
                    return self.end_window(trouble, losses, taken, data_wait, failures, data_error, window)

    def accumulate(self, last: bool) -> contextlib.AbstractContextManager:
        """``accelerator.accumulate`` with the window's end decided here, from the batches'
        own positions, the same on every rank (the prefetching thread runs ahead of the step,
        so the loader's end-of-epoch state is not this batch's): the accelerator counts
        micro-batches and syncs at each multiple of the window (``sync_with_dataloader`` is off,
        ``make_accelerator``), so its count is set to sync exactly at ``last``."""
        steps = self.config.gradient_accumulation_steps
        library_seams.set_micro_batch_count(self.accelerator, steps - 1 if last else 0)
        return self.accelerator.accumulate(self.model)

    def micro_batch(
        self, batch: dict | None, window: int, trouble: WindowTrouble, last: bool
    ) -> dict[str, torch.Tensor] | None:
        """One micro-batch inside ``accumulate``: the forward pass, this rank's gradients
        (``torch.autograd.grad``, which no gradient hook or collective sees) and their hand-over
        to the optimizer (the one backward pass the distributed wrappers see). NaN gradients are
        handed over instead when the forward or backward pass ran out of memory or failed to
        compile, or the rank has no batch (``batch`` None: its data is gone): every rank then
        runs the same collectives, and the agreed flags skip the window. Returns the detached
        loss terms (None when nothing was trained); ``trouble`` keeps what went wrong."""
        forward, z_ref = self.forward_pass(batch, window, trouble) if batch is not None else (None, None)
        if forward is not None:
            trouble.add_loss(forward.losses["loss"])
        if self.seraena is not None:  # the other ranks wait for this rank's flags before their discriminator step
            settled = self.settle(trouble)
            if settled.problem is None and not settled.data_failed and forward is not None:
                self.add_seraena_loss(forward, z_ref)
        grads = self.gradients(forward.losses["loss"], window, trouble) if forward is not None else None
        if grads is not None:
            if self.engine is not None:  # elsewhere the window's clipping norm shows a non-finite gradient
                trouble.add_gradients([g for g in grads if g is not None])
            self.hand_over(grads, last)
            return {name: value.detach() for name, value in forward.losses.items()}
        if forward is None:
            self.prepare_reducer()
        del forward  # a failed backward pass's activations: freed before the hand-over
        self.hand_over([torch.full_like(p, math.nan) for p in self.trainable], last)
        return None

    def forward_pass(
        self, batch: dict, window: int, trouble: WindowTrouble
    ) -> tuple[Forward | None, torch.Tensor | None]:
        """The forward pass and losses of ``batch`` (compiled, else eager: a compilation that
        fails here is run again eagerly at once), with its reference latents; (None, None)
        when it ran out of memory."""
        acc, rank = self.accelerator, self.accelerator.process_index
        out_of_memory = False
        try:
            frames = frames_to_unit(batch["frames"], acc.device)
            z_ref = self.latents(batch, frames, self.generator)
            try:
                forward = self.forward(frames, z_ref)
            except torch.OutOfMemoryError:
                raise
            except Exception as err:  # not swallowed: an eager model raises it again below
                if not self.unwrapped_model.compiled:
                    raise
                self.compile_failed(err, trouble)
                forward = self.forward(frames, z_ref)
            forward.losses["loss"] = self.faults.inject_forward(window, rank, forward.losses["loss"])
            return forward, z_ref
        except torch.OutOfMemoryError as err:
            logger.error("out of memory in the forward pass of window %d: %s", window, err)
            out_of_memory = trouble.out_of_memory = True
        if out_of_memory:
            free_cached_memory()  # outside the except block, whose traceback holds the activations
        return None, None

    def gradients(self, loss: torch.Tensor, window: int, trouble: WindowTrouble) -> list[torch.Tensor | None] | None:
        """This rank's gradients of ``loss`` for the trained parameters, None when the
        backward pass ran out of memory or its compilation failed (the window is then skipped
        on every rank; a failed compilation also leaves every rank eager)."""
        rank, failed = self.accelerator.process_index, False
        try:
            loss = self.faults.inject_backward(window, rank, loss)
            if (scale := self.loss_scale()) is not NO_SCALE:
                loss = loss * scale
            return list(torch.autograd.grad(loss, self.trainable, allow_unused=True))
        except torch.OutOfMemoryError as err:
            logger.error("out of memory in the backward pass of window %d: %s", window, err)
            failed = trouble.out_of_memory = True
        except Exception as err:  # not swallowed: an eager model's error is raised, a compiled one's skips the window
            if not self.unwrapped_model.compiled:
                raise
            self.compile_failed(err, trouble)
            failed = trouble.backward_failed = True
        if failed:
            free_cached_memory()
        return None

    def hand_over(self, gradients: list[torch.Tensor | None], last: bool) -> None:
        """Give ``gradients`` to the optimizer through a backward pass of ``sum(p * g)``,
        whose gradient for each parameter p is g: DDP's and ZeRO's hooks, the accumulation
        scaling and the loss scaler see an ordinary backward pass, the same one on every rank
        (so a rank that failed meets the others' collectives with its NaN gradients)."""
        surrogate = sum((p * g).sum() for p, g in zip(self.trainable, gradients) if g is not None)
        if (scale := self.loss_scale()) is not NO_SCALE:
            surrogate = surrogate / scale  # the scaler multiplies it back: exactly g
        if self.engine is not None:
            deepspeed_engine.backward(self.engine, surrogate, last)
        else:
            self.accelerator.backward(surrogate)

    def loss_scale(self) -> torch.Tensor | float:
        """fp16's loss scale (gradients are taken of the scaled loss, as the scaler would),
        else ``NO_SCALE``."""
        if self.engine is not None:
            scale = library_seams.zero_loss_scale(self.engine)
            return NO_SCALE if scale == 1 else scale
        scaler = self.accelerator.scaler
        return NO_SCALE if scaler is None else scaler.scale(torch.ones((), device=self.accelerator.device))

    def prepare_reducer(self) -> None:
        """Under DDP, a forward pass through the wrapper (eager, on a placeholder clip) for a
        rank that has none, so that its gradient hand-over reaches the other ranks' buckets."""
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            with self.unwrapped_model.eager():
                self.model(*self.placeholder_batch(), decode_own=True)

    def compile_failed(self, err: Exception, trouble: WindowTrouble) -> None:
        """This rank leaves the compiled model; the window's end tells the other ranks."""
        self.unwrapped_model.run_eager(f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}")
        trouble.compile_failed = True

    def end_window(
        self,
        trouble: WindowTrouble,
        losses: list[dict[str, torch.Tensor]],
        taken: int,
        data_wait: float,
        failures: torch.Tensor,
        data_error: VideoDataError | WaitInterrupted | None,
        window: int,
    ) -> StepResult:
        """At the window's last micro-batch, inside ``accumulate``: settle the window over all
        ranks, then take the optimizer step, the schedule's and the EMA weights' (clipping the
        gradients first), or drop the window's gradients on every rank; under DeepSpeed its
        engine steps (``training.loop.deepspeed_engine``). An out-of-memory error in the
        optimizer step may leave the weights half-updated: the run ends (``OptimizerStepFailed``)."""
        acc = self.accelerator
        grad_norm = None
        if self.engine is None:
            grad_norm = acc.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm or math.inf)
        settled = self.settle(trouble, grad_norm)
        if settled.compile_failed:
            self.unwrapped_model.run_eager("on another rank")
        applied, problem = settled.problem is None and not settled.data_failed, settled.problem
        try:
            if applied:
                self.faults.maybe_oom_in_step(window, acc.process_index)
            if self.engine is not None:
                if applied:
                    applied = deepspeed_engine.apply(self.engine)
                    problem = None if applied else "non-finite gradient (DeepSpeed's overflow check)"
                    grad_norm = self.engine.get_global_grad_norm()
                else:
                    deepspeed_engine.drop(self.engine)
            elif applied:
                self.optimizer.step()
        except torch.OutOfMemoryError as err:
            raise OptimizerStepFailed(f"out of memory in the optimizer step of window {window} ({err})") from err
        if applied:
            self.scheduler.step()
        elif acc.scaler is not None:
            acc.scaler.update()  # fp16: lower the loss scale as the scaler's own skip would
        self.optimizer.zero_grad(set_to_none=True)
        if applied and self.ema is not None:
            self.ema.step(self.trainable)
        self.idle.pause()  # the window's work is queued; the loop's bookkeeping runs until the next window
        return StepResult(
            applied,
            None if applied or settled.data_failed else problem,
            losses if applied else [],
            None if settled.data_failed else grad_norm,
            settled.stop_requested,
            taken,
            data_wait,
            failures,
            data_failed=settled.data_failed,
            data_error=data_error,
        )

    def settle(self, trouble: WindowTrouble, grad_norm: torch.Tensor | float | None = None) -> Settled:
        """``trouble`` agreed over the ranks and read (the host waits for the device here)."""
        self.idle.pause()
        settled = trouble.settle(self.stop, grad_norm)
        self.idle.resume()
        return settled

    @property
    def schedule(self) -> LearningRateSchedule:
        """The learning-rate schedule (a time budget sets its horizon once the run's speed is known)."""
        return library_seams.lr_lambda(self.scheduler)

    def forward(self, frames: torch.Tensor, z_ref: torch.Tensor | None) -> Forward:
        return training_forward(self.accelerator, self.forward_module, frames, z_ref, self.config, self.input_dtype)

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
        """A tiny clip (and reference latents) with the training frame count: under DDP, the
        forward pass through the wrapper of a rank that has none of its own (``prepare_reducer``)."""
        device, size = self.accelerator.device, 8 * self.unwrapped_model.patch_size
        frames = torch.zeros(1, self.config.n_frames, self.unwrapped_model.image_channels, size, size, device=device)
        if not self.latents.available:
            return frames, None
        latents = self.unwrapped_model.plan(self.config.n_frames).latent_frames
        return frames, torch.zeros(1, latents, self.unwrapped_model.latent_channels, 1, 1, device=device)

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
