"""Seraena: adversarial targets for the decoder without an adversarial loss.

A conditional patch discriminator learns to tell decoded frames ("fakes") from real ones,
given the latent they were decoded from as context. Instead of back-propagating a GAN loss
through the decoder, Seraena asks the discriminator which small change of each fake would
make it score like the matching real sample, normalises that change to unit scale and
returns ``fake + correction`` as a plain regression target: the decoder then minimises
``MSE(decoded, target)``. Old fakes are replayed from a buffer so the discriminator does not
just chase the decoder's latest mistakes.

Samples are groups of frames stacked on channels, ``(G, image_channels, H, W)`` in [0, 1]
(``models.frames.group_frames``), with context ``(G, context_channels, h, w)``.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

logger = logging.getLogger(__name__)

WIDTHS = (64, 128, 256, 512, 512, 512)
STRIDES = (1, 2, 2, 2, 1, 1)
GROUPS = 32  # GroupNorm groups; divides every width
BUFFER_DTYPE = torch.float32
STD_EPSILON = 1e-12  # a discriminator without any gradient gives a zero correction, not NaN


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class SeraenaDiscriminator(nn.Module):
    """Patch discriminator with context: one score map per block, all at H/8 x W/8.

    The context (a latent, h x w) is resized to the image size with nearest-neighbour
    interpolation, so each latent pixel conditions exactly the image patch it encodes and no
    sub-latent structure is invented. Scores of the shallow blocks (fine texture) and the
    deep ones (structure) are average-pooled to a common grid and stacked: (G, 6, H/8, W/8).
    """

    def __init__(self, image_channels: int, context_channels: int, norm: str = "group"):
        super().__init__()
        blocks, heads = [], []
        n_in = image_channels + context_channels
        for width, stride in zip(WIDTHS, STRIDES):
            kernel = 4 if stride == 2 else 3
            blocks.append(
                nn.Sequential(
                    nn.Conv2d(n_in, width, kernel, stride=stride, padding=1, bias=False),
                    nn.GroupNorm(GROUPS, width) if norm == "group" else nn.BatchNorm2d(width),
                    nn.ReLU(inplace=True),
                )
            )
            heads.append(nn.Conv2d(width, 1, 1))
            n_in = width
        self.blocks = nn.ModuleList(blocks)
        self.heads = nn.ModuleList(heads)

    def forward(self, image: Tensor, context: Tensor) -> Tensor:
        h, w = image.shape[-2:]
        x = torch.cat([image * 2 - 1, F.interpolate(context, size=(h, w), mode="nearest")], 1)
        scores = []
        for block, head in zip(self.blocks, self.heads):
            x = block(x)
            scores.append(F.adaptive_avg_pool2d(head(x), (h // 8, w // 8)))
        return torch.cat(scores, 1)


class Seraena(nn.Module):
    """Conditional patch discriminator + replay buffer that turns its gradients into
    'corrected' targets for the decoder (relativistic correction, unit scale).

    Differences from the published design, and why:

    - ``norm="group"`` (default) replaces BatchNorm with GroupNorm: its statistics are per
      sample, so they do not depend on the batch, the rank or the real/fake mix, and every
      rank keeps an identical discriminator without SyncBatchNorm. ``norm="batch"`` keeps
      BatchNorm for fidelity; with several processes it is converted to SyncBatchNorm
      (GPU only in torch).
    - Multi-process runs (``torch.distributed`` initialised, world size > 1): the weights
      are broadcast from rank 0 at the first step and the gradients are averaged over ranks
      before every optimizer step, so all ranks hold the same discriminator although each
      sees its own data and keeps its own replay buffer. Every rank must call
      ``step_and_make_correction_targets`` at every step (it runs collectives).

    The module lives on the inputs' device (``seraena.to(device)``). On CUDA the forward
    passes run under fp16 autocast with a ``torch.amp.GradScaler``; elsewhere in fp32.
    The replay buffer is fp32 on that device too: for ``Seraena(9, 16)`` and 16384 samples
    about 2.3 GiB at 64x64 but 130 GiB at 480x480, so size it with ``estimate_buffer_bytes``.
    All randomness (initial weights, buffer replacement and sampling, the real/fake mask)
    comes from ``seed`` and the module's own ``torch.Generator``, so runs are reproducible
    and resume exactly without touching the global random streams.
    """

    def __init__(
        self,
        image_channels: int,
        context_channels: int,
        *,
        buffer_size: int = 16384,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.01,
        norm: str = "group",
        seed: int = 0,
    ):
        super().__init__()
        if norm not in ("group", "batch"):
            raise ValueError(f"norm must be 'group' or 'batch', got {norm!r}")
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        self.image_channels = image_channels
        self.context_channels = context_channels
        self.buffer_size = buffer_size
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.discriminator: nn.Module = SeraenaDiscriminator(image_channels, context_channels, norm)
        if norm == "batch" and _world_size() > 1:
            self.discriminator = nn.SyncBatchNorm.convert_sync_batchnorm(self.discriminator)
        self.optimizer = torch.optim.AdamW(
            self.discriminator.parameters(), lr=lr, betas=betas, weight_decay=weight_decay
        )
        self._scaler: torch.amp.GradScaler | None = None  # created at the first CUDA step
        self._generator = torch.Generator().manual_seed(seed)
        self._images: Tensor | None = None  # replay buffer, allocated at the first step
        self._context: Tensor | None = None
        self._count = 0
        self._weights_synced = False

    def forward(self, image: Tensor, context: Tensor) -> Tensor:
        """Discriminator scores (G, 6, H/8, W/8): positive means "looks decoded"."""
        return self.discriminator(image, context)

    # -- memory -----------------------------------------------------------------------
    @staticmethod
    def estimate_buffer_bytes(
        buffer_size: int,
        image_channels: int,
        context_channels: int,
        height: int,
        width: int,
        context_height: int,
        context_width: int,
    ) -> int:
        """Bytes a full replay buffer takes (to size it in the config before allocating)."""
        per_sample = image_channels * height * width + context_channels * context_height * context_width
        return buffer_size * per_sample * BUFFER_DTYPE.itemsize

    def buffer_bytes(self) -> int:
        """Bytes the full replay buffer takes for the sample shape seen; 0 before the first step."""
        if self._images is None or self._context is None:
            return 0
        _, c, h, w = self._images.shape
        _, cc, ch, cw = self._context.shape
        return self.estimate_buffer_bytes(self.buffer_size, c, cc, h, w, ch, cw)

    # -- the step ---------------------------------------------------------------------
    @torch.enable_grad()
    def step_and_make_correction_targets(
        self, real: Tensor, fake: Tensor, ctx: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """real, fake: (G, image_channels, H, W) in [0, 1] (groups of frames stacked on channels);
        ctx: (G, context_channels, h, w). One discriminator optimizer step, then returns
        (corrected target (G, image_channels, H, W), detached, same dtype as fake; stats dict with
        'disc_loss', 'correction_norm', 'gradient_rms', 'relativistic_gap', 'buffer_fill' as 0-dim
        float tensors)."""
        self._check_inputs(real, fake, ctx)
        out_dtype = fake.dtype
        real, fake, ctx = (t.detach().float() for t in (real, fake, ctx))
        self._sync_weights_once()
        self._push(fake, ctx)
        disc_loss = self._train_discriminator(real, fake, ctx)
        target, stats = self._correction_targets(real, fake, ctx)
        stats["disc_loss"] = disc_loss
        stats["buffer_fill"] = torch.tensor(self._count / self.buffer_size, device=fake.device)
        return target.to(out_dtype), stats

    def _check_inputs(self, real: Tensor, fake: Tensor, ctx: Tensor) -> None:
        if real.shape != fake.shape or fake.ndim != 4 or fake.shape[1] != self.image_channels:
            raise ValueError(
                f"Seraena expects real and fake of shape (G, {self.image_channels}, H, W), "
                f"got {tuple(real.shape)} and {tuple(fake.shape)}"
            )
        g, _, h, w = fake.shape
        if g == 0 or g % 2:
            raise ValueError(
                f"Seraena needs an even, non-zero number of samples per step (it splits the batch "
                f"into halves), got G={g}: use an even batch size or number of frame groups"
            )
        if h % 8 or w % 8:
            raise ValueError(f"Seraena needs H and W multiples of 8, got {h}x{w}")
        if ctx.ndim != 4 or ctx.shape[0] != g or ctx.shape[1] != self.context_channels:
            raise ValueError(
                f"Seraena expects ctx of shape ({g}, {self.context_channels}, h, w), got {tuple(ctx.shape)}"
            )
        device = next(self.discriminator.parameters()).device
        if not (fake.device == real.device == ctx.device == device):
            raise ValueError(
                f"Seraena is on {device} but got inputs on {real.device}/{fake.device}/{ctx.device}: "
                "move it with seraena.to(device)"
            )

    def _autocast(self, device: torch.device) -> torch.autocast:
        return torch.autocast(device.type, dtype=torch.float16, enabled=device.type == "cuda")

    def _sync_weights_once(self) -> None:
        """Start every rank from rank 0's weights, whatever seed each rank was given."""
        if not self._weights_synced and _world_size() > 1:
            for tensor in self.discriminator.state_dict().values():
                dist.broadcast(tensor, src=0)
        self._weights_synced = True

    def _push(self, images: Tensor, context: Tensor) -> None:
        """Append new fakes while there is room, then overwrite random (distinct) slots."""
        if self._images is None or self._context is None:
            self._images = images.new_empty((self.buffer_size, *images.shape[1:]), dtype=BUFFER_DTYPE)
            self._context = context.new_empty((self.buffer_size, *context.shape[1:]), dtype=BUFFER_DTYPE)
            logger.info(
                "Seraena replay buffer: %d samples of %s + context %s = %.2f GB on %s",
                self.buffer_size,
                tuple(images.shape[1:]),
                tuple(context.shape[1:]),
                self.buffer_bytes() / 1e9,
                images.device,
            )
        elif self._images.shape[1:] != images.shape[1:] or self._context.shape[1:] != context.shape[1:]:
            raise ValueError(
                f"Seraena's replay buffer holds samples {tuple(self._images.shape[1:])} with context "
                f"{tuple(self._context.shape[1:])}, got {tuple(images.shape[1:])} and "
                f"{tuple(context.shape[1:])}: the sample size cannot change during a run"
            )
        n = min(len(images), self.buffer_size)
        appended = min(self.buffer_size - self._count, n)
        self._images[self._count : self._count + appended] = images[:appended]
        self._context[self._count : self._count + appended] = context[:appended]
        self._count += appended
        if appended < n:
            slots = torch.randperm(self.buffer_size, generator=self._generator)[: n - appended].to(images.device)
            self._images.index_copy_(0, slots, images[appended:n])
            self._context.index_copy_(0, slots, context[appended:n])

    def _sample(self, k: int) -> tuple[Tensor, Tensor]:
        assert self._images is not None and self._context is not None
        index = torch.randint(self._count, (k,), generator=self._generator).to(self._images.device)
        return self._images[index], self._context[index]

    def _train_discriminator(self, real: Tensor, fake: Tensor, ctx: Tensor) -> Tensor:
        """One optimizer step on a batch where a random mask picks, per sample, the real
        image or a fake (first half: the new fakes, second half: replayed ones); target
        score -1 for real, +1 for fake."""
        g, device = len(fake), fake.device
        half = g // 2
        old_images, old_context = self._sample(g - half)
        fake_images = torch.cat([fake[:half], old_images])
        fake_context = torch.cat([ctx[:half], old_context])
        is_real = (torch.rand(g, generator=self._generator) < 0.5).to(device).view(g, 1, 1, 1)
        images = torch.where(is_real, real, fake_images)
        context = torch.where(is_real, ctx, fake_context)

        self.discriminator.train()
        with self._autocast(device):
            scores = self.discriminator(images, context)
        labels = torch.where(is_real, -1.0, 1.0).expand_as(scores)
        loss = F.mse_loss(scores.float(), labels)
        self.optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda" and self._scaler is None:
            self._scaler = torch.amp.GradScaler("cuda")
        if self._scaler is not None:
            self._scaler.scale(loss).backward()
            self._average_gradients()
            self._scaler.step(self.optimizer)
            self._scaler.update()
        else:
            loss.backward()
            self._average_gradients()
            self.optimizer.step()
        return loss.detach()

    def _average_gradients(self) -> None:
        """Average gradients over ranks (one flat all-reduce) so the discriminators stay identical.

        A non-finite gradient on any rank becomes non-finite everywhere, so a grad scaler
        skips the step on all ranks together."""
        world = _world_size()
        if world == 1:
            return
        params = list(self.discriminator.parameters())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat)
        flat /= world
        for param, chunk in zip(params, flat.split([grad.numel() for grad in grads])):
            param.grad = chunk.view_as(param)

    def _correction_targets(self, real: Tensor, fake: Tensor, ctx: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """target = fake + correction, with correction = -grad / std(grad) of
        sum_i ||D(fake_i + c_i) - D(real_i)||^2 at c = 0 (discriminator in eval mode).

        The squared errors are summed, not averaged, over each sample's scores: after the
        std normalisation the correction is the same, and fp16 gradients stay clear of
        underflow at large resolutions."""
        self.discriminator.eval()
        with torch.no_grad(), self._autocast(fake.device):
            real_scores = self.discriminator(real, ctx).float()
        correction = torch.zeros_like(fake, requires_grad=True)
        with self._autocast(fake.device):
            fake_scores = self.discriminator(fake + correction, ctx).float()
        gap = (fake_scores - real_scores).pow(2).flatten(1).sum(1)
        (grad,) = torch.autograd.grad(gap.sum(), correction)
        correction = -grad / grad.std().clamp_min(STD_EPSILON)
        stats = {
            "correction_norm": correction.pow(2).mean().sqrt(),  # RMS: 1, or 0 without any gradient
            "gradient_rms": grad.pow(2).mean().sqrt(),  # how strongly the discriminator separates
            "relativistic_gap": gap.detach().mean() / real_scores[0].numel(),  # mean per-sample MSE
        }
        return (fake + correction).detach(), stats

    # -- exact resume -----------------------------------------------------------------
    def training_state(self) -> dict[str, Tensor]:
        """Everything needed to resume exactly, as a flat dict of contiguous tensors (for
        safetensors). The tensors are the live ones (no copy of a multi-GB buffer): save
        them before the next step."""
        state = {f"discriminator.{k}": v.detach().contiguous() for k, v in self.discriminator.state_dict().items()}
        for index, param_state in self.optimizer.state_dict()["state"].items():
            for name, value in param_state.items():
                state[f"optimizer.{index}.{name}"] = value.detach().contiguous()
        if self._scaler is not None:
            for name, value in self._scaler.state_dict().items():
                state[f"scaler.{name}"] = torch.tensor(
                    value, dtype=torch.int64 if isinstance(value, int) else torch.float64
                )
        state["buffer.count"] = torch.tensor(self._count, dtype=torch.int64)
        if self._images is not None and self._context is not None:
            state["buffer.images"] = self._images[: self._count]
            state["buffer.context"] = self._context[: self._count]
        state["generator"] = self._generator.get_state()
        return state

    def load_training_state(self, state: dict[str, Tensor]) -> None:
        """Restore ``training_state()`` (tensors may be on any device); strict about keys."""
        unknown = [
            k
            for k in state
            if not k.startswith(("discriminator.", "optimizer.", "scaler.", "buffer.")) and k != "generator"
        ]
        if unknown or "generator" not in state or "buffer.count" not in state:
            raise ValueError(
                f"not a Seraena training state (unknown keys {unknown[:5]}, "
                f"generator/buffer.count present: {'generator' in state}/{'buffer.count' in state})"
            )
        device = next(self.discriminator.parameters()).device
        prefix = "discriminator."
        self.discriminator.load_state_dict(
            {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, strict=True
        )

        optimizer_state: dict[int, dict[str, Tensor]] = {}
        for key, value in state.items():
            if key.startswith("optimizer."):
                _, index, name = key.split(".", 2)
                # AdamW keeps its step counter on the CPU unless it is capturable or fused
                optimizer_state.setdefault(int(index), {})[name] = value.cpu() if name == "step" else value
        self.optimizer.load_state_dict(
            {"state": optimizer_state, "param_groups": self.optimizer.state_dict()["param_groups"]}
        )

        scaler_state = {k[len("scaler.") :]: v.item() for k, v in state.items() if k.startswith("scaler.")}
        if scaler_state and device.type == "cuda":
            self._scaler = torch.amp.GradScaler("cuda")
            self._scaler.load_state_dict(scaler_state)
        elif scaler_state:
            logger.warning("Seraena: ignoring the saved grad-scaler state (this run is on %s, in fp32)", device)

        count = int(state["buffer.count"])
        if count > self.buffer_size:
            raise ValueError(f"the saved replay buffer holds {count} samples, more than buffer_size={self.buffer_size}")
        self._count = count
        if "buffer.images" in state:
            images, context = state["buffer.images"], state["buffer.context"]
            self._images = torch.empty((self.buffer_size, *images.shape[1:]), dtype=BUFFER_DTYPE, device=device)
            self._context = torch.empty((self.buffer_size, *context.shape[1:]), dtype=BUFFER_DTYPE, device=device)
            self._images[:count] = images
            self._context[:count] = context
        else:
            self._images = self._context = None
        self._generator.set_state(state["generator"].cpu())
