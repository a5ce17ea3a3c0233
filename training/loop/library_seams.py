"""Every place training reaches into a library's internals (attributes and modules that
Accelerate, DeepSpeed and torch do not document as their API), one short function each.

Each seam names the library file and function it relies on, as read in the versions of
``CHECKED_WITH``; tests/test_library_seams.py checks each on real objects and fails, naming
the seams to re-check, when the installed versions differ from these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import DistributedType

CHECKED_WITH = {"accelerate": "1.15.0", "deepspeed": "0.19.8", "torch": "2.13.0"}

# --- Accelerate ---------------------------------------------------------------------------


def set_micro_batch_count(accelerator: Any, count: int) -> None:
    """Set the micro-batches Accelerate counts in the current window: ``accumulate`` adds one
    and syncs when the count is a multiple of the window (accelerate/accelerator.py,
    ``Accelerator._do_sync``: ``self.step += 1``, then ``self.step % num_steps == 0``), so
    the step ends its windows where it decides."""
    accelerator.step = count


def syncs_with_dataloader(accelerator: Any) -> bool:
    """Whether Accelerate ends a window at the loader's end itself (accelerate/state.py,
    ``GradientState.sync_with_dataloader``, read by ``Accelerator._do_sync``)."""
    return accelerator.gradient_state.sync_with_dataloader


def keep_batches_on_host(loader: Any) -> None:
    """A prepared loader whose batches stay where the loader made them: ``DataLoaderShard``
    copies a batch only when its ``device`` is set (accelerate/data_loader.py,
    ``DataLoaderShard.__iter__``), and ``prepare`` refuses per-object placement under DeepSpeed."""
    loader.device = None


def wrapped_deepspeed_engine(accelerator: Any) -> Any:
    """The DeepSpeed engine Accelerate built in ``prepare`` (accelerate/accelerator.py,
    ``Accelerator._prepare_deepspeed`` keeps it as ``deepspeed_engine_wrapped``, a
    ``DeepSpeedEngineWrapper`` of accelerate/utils/deepspeed.py holding ``engine``)."""
    return accelerator.deepspeed_engine_wrapped.engine


def unwrapped_model(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
    """The module inside what ``accelerator.prepare`` returned. ``Accelerator.unwrap_model``
    imports DeepSpeed whenever it is installed, to recognise its engine (accelerate/utils/
    other.py, ``extract_model_from_parallel``): about a second of every process's start-up.
    Only a DeepSpeed run needs it; another holds the module itself or a data-parallel wrapper
    of it (the model compiles in place: ``TrainStep.build``)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.unwrap_model(model)
    parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return model.module if isinstance(model, parallel) else model


# --- torch --------------------------------------------------------------------------------


def lr_lambda(scheduler: Any) -> Callable[[int], float]:
    """The function a ``LambdaLR`` was built with (torch/optim/lr_scheduler.py,
    ``LambdaLR.__init__`` keeps one per parameter group in ``lr_lambdas``), through
    Accelerate's wrapper (accelerate/scheduler.py, ``AcceleratedScheduler.scheduler``)."""
    return getattr(scheduler, "scheduler", scheduler).lr_lambdas[0]


def storage_key(tensor: torch.Tensor) -> int:
    """One key per storage, shared by every view of it (torch/storage.py,
    ``UntypedStorage._cdata``: the address of the C++ storage, what ``__deepcopy__`` keys its memo on)."""
    return tensor.untyped_storage()._cdata


def compile_backends() -> list[str]:
    """The ``torch.compile`` backends this torch knows, its debugging ones (``aot_eager``,
    ``eager``) included (torch/_dynamo/backends/registry.py, ``list_backends``)."""
    import torch._dynamo  # seconds to import: only when a compile backend is checked or registered

    return torch._dynamo.list_backends(exclude_tags=())


def register_compile_backend(
    name: str, forward_compiler: Callable[..., Any], backward_compiler: Callable[..., Any]
) -> None:
    """A ``torch.compile`` backend ``name`` whose forward and backward graphs go to the two
    compilers (torch/_dynamo/backends/common.py, ``aot_autograd``; torch/_dynamo/backends/
    registry.py, ``register_backend``)."""
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.register_backend(aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler), name)


# --- DeepSpeed ----------------------------------------------------------------------------


def forgo_deepspeed_shm_kernel() -> None:
    """Mark DeepSpeed's shared-memory all-reduce kernel for CPUs unavailable, before its process
    group starts. ``TorchBackend.__init__`` (deepspeed/comm/torch.py) builds it with
    ``build_shm_op``, which skips a kernel whose entry in ``deepspeed.ops.__compatible_ops__``
    is False (deepspeed/ops/__init__.py keeps that table as a module attribute whose edits
    persist); otherwise it compiles its C++ (ninja, ``TORCH_EXTENSIONS_DIR``) on a machine's
    first run and whenever the environment's path changes: 20-45 s on 2 cores. Only
    ``inference_all_reduce`` uses it (deepspeed/module_inject, tensor-parallel inference);
    ZeRO's collectives are torch.distributed's."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:  # accelerators other than the CPU have no such kernel
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def has_overflow_switch(engine: Any) -> bool:
    """Whether the ZeRO optimizer has the switch of its gradient overflow check
    (deepspeed/runtime/zero/stage_1_and_2.py, ``DeepSpeedZeroOptimizer.__init__`` keeps
    ``check_grad_overflow``, read in ``step``; from DeepSpeed 0.17.1)."""
    return hasattr(engine.optimizer, "check_grad_overflow")


def overflow_check(engine: Any) -> bool:
    """Whether the ZeRO optimizer's overflow check is on (``has_overflow_switch``'s attribute)."""
    return engine.optimizer.check_grad_overflow


def set_overflow_check(engine: Any, on: bool) -> None:
    """Switch the ZeRO optimizer's overflow check (``has_overflow_switch``'s attribute), which
    its ``step`` reads at each call."""
    engine.optimizer.check_grad_overflow = on


def zero_loss_scale(engine: Any) -> float:
    """The ZeRO optimizer's current loss scale (deepspeed/runtime/zero/stage_1_and_2.py,
    ``DeepSpeedZeroOptimizer.loss_scale``: fp16's dynamic scale, 1 in bf16 and fp32)."""
    return float(getattr(engine.optimizer, "loss_scale", 1.0))


# The ZeRO optimizer's state holds its loss scaler as an object and a table of fragment
# addresses (deepspeed/runtime/zero/stage_1_and_2.py, ``DeepSpeedZeroOptimizer.state_dict``,
# keys of deepspeed/checkpoint/constants.py); the scaler is saved as its plain attributes,
# the table (only used by universal checkpoints) is left out.
LOSS_SCALER, PARAM_SLICE_MAPPINGS = "loss_scaler", "param_slice_mappings"
_PLAIN = (bool, int, float, str, type(None), torch.Tensor)


def zero_optimizer_state(zero_optimizer: Any) -> dict:
    """This rank's shard of the ZeRO optimizer's state, with nothing that needs pickling."""
    state = dict(zero_optimizer.state_dict())
    scaler = state.pop(LOSS_SCALER, None)
    state.pop(PARAM_SLICE_MAPPINGS, None)
    state["loss_scaler_attributes"] = {k: v for k, v in vars(scaler).items() if isinstance(v, _PLAIN)} if scaler else {}
    return state


def load_zero_optimizer_state(zero_optimizer: Any, state: dict, rank: int, world_size: int) -> None:
    """Restore ``zero_optimizer_state``'s shard: ``load_state_dict`` takes one state per rank
    (``DeepSpeedZeroOptimizer.load_state_dict``, its legacy path), the scaler's attributes
    are set back on the scaler it keeps (``loss_scaler``)."""
    scaler_attributes = state.pop("loss_scaler_attributes")
    per_rank = [None] * world_size
    per_rank[rank] = state
    zero_optimizer.load_state_dict(per_rank, load_optimizer_states=True, load_from_fp32_weights=True)
    for name, value in scaler_attributes.items():
        setattr(zero_optimizer.loss_scaler, name, value)
