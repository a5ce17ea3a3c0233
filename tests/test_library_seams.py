"""Each seam into a library's internals (training/loop/library_seams.py) on real objects of
the installed Accelerate, DeepSpeed and torch, and the versions its citations were read in:
another version, in requirements.txt or installed, fails here naming the seams to re-check.
A live ZeRO-2 engine runs the DeepSpeed seams in tests/test_zero2_faults.py."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from importlib.metadata import version
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DeepSpeedEngineWrapper, DistributedType, GradientAccumulationPlugin
from packaging.specifiers import SpecifierSet
from torch.utils.data import DataLoader, TensorDataset

from conftest import REPO_ROOT
from taehv_train.training.loop import library_seams
from taehv_train.training.loop.library_seams import CHECKED_WITH

RELIES_ON = {
    "accelerate": (
        "set_micro_batch_count",
        "syncs_with_dataloader",
        "keep_batches_on_host",
        "wrapped_deepspeed_engine",
        "unwrapped_model",
        "lr_lambda",
    ),
    "torch": ("lr_lambda", "storage_key", "compile_backends", "register_compile_backend"),
    "deepspeed": (
        "forgo_deepspeed_shm_kernel",
        "has_overflow_switch",
        "overflow_check",
        "set_overflow_check",
        "zero_loss_scale",
        "zero_optimizer_state",
        "load_zero_optimizer_state",
    ),
}
REQUIRED = {"accelerate": "==1.15.0", "deepspeed": "==0.19.8", "torch": "==2.13.0"}  # requirements.txt


def recheck(library: str, found: str) -> str:
    return f"re-check {', '.join(RELIES_ON[library])} against {library} {found}, then update CHECKED_WITH/REQUIRED"


def test_every_seam_names_the_libraries_it_relies_on():
    seams = {
        name
        for name, value in vars(library_seams).items()
        if inspect.isfunction(value) and value.__module__ == library_seams.__name__
    }
    assert seams == {name for names in RELIES_ON.values() for name in names}


@pytest.mark.parametrize("library", sorted(RELIES_ON))
def test_the_seams_were_read_in_the_versions_installed_and_required(library):
    installed = version(library).split("+")[0]  # a torch build's local label (+cpu, +cu128) aside
    assert installed == CHECKED_WITH[library], recheck(library, installed)
    lines = (REPO_ROOT / "requirements.txt").read_text().splitlines()
    required = next(re.sub(r"#.*", "", line).strip()[len(library) :] for line in lines if line.startswith(library))
    assert required == REQUIRED[library], recheck(library, required)
    assert CHECKED_WITH[library] in SpecifierSet(required), recheck(library, required)


@pytest.fixture
def fresh_state():
    """Accelerate's process-wide state, reset around a test that builds its own Accelerator."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.mark.parametrize("with_loader", [False, True])
def test_the_micro_batch_count_decides_where_accumulate_syncs(fresh_state, with_loader):
    plugin = GradientAccumulationPlugin(num_steps=3, sync_with_dataloader=with_loader)
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    assert library_seams.syncs_with_dataloader(accelerator) is with_loader
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    for count, syncs in ((0, False), (2, True), (1, False), (2, True)):
        library_seams.set_micro_batch_count(accelerator, count)
        with accelerator.accumulate(model):
            assert accelerator.sync_gradients is syncs, count


def test_a_loader_kept_on_the_host_copies_no_batch(fresh_state):
    loader = Accelerator(cpu=True).prepare(DataLoader(TensorDataset(torch.zeros(2, 1)), batch_size=1))
    loader.device = torch.device("meta")  # stands for a GPU: the loader copies its batches there
    assert next(iter(loader))[0].device.type == "meta"
    library_seams.keep_batches_on_host(loader)
    assert next(iter(loader))[0].device.type == "cpu"


def test_the_deepspeed_engine_is_the_one_accelerate_wraps():
    engine = object()
    accelerator = SimpleNamespace(deepspeed_engine_wrapped=DeepSpeedEngineWrapper(engine))
    assert library_seams.wrapped_deepspeed_engine(accelerator) is engine
    assert "self.deepspeed_engine_wrapped = DeepSpeedEngineWrapper(" in inspect.getsource(Accelerator)


def test_the_unwrapped_model_is_accelerates_without_importing_deepspeed_outside_a_deepspeed_run():
    """The module Accelerate's ``unwrap_model`` finds, for the wrappers a run without
    DeepSpeed can have; a DeepSpeed run asks Accelerate itself. A process that trains
    without DeepSpeed never imports it (a second of start-up)."""
    accelerator, module = Accelerator(cpu=True), torch.nn.Linear(2, 2)
    for prepared in (module, torch.nn.DataParallel(module)):
        assert library_seams.unwrapped_model(accelerator, prepared) is accelerator.unwrap_model(prepared) is module
    engine = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, unwrap_model=lambda model: ("asked", model))
    assert library_seams.unwrapped_model(engine, module) == ("asked", module)
    code = (
        "import sys, torch; from accelerate import Accelerator; "
        "from taehv_train.training.loop.library_seams import unwrapped_model; "
        "a = Accelerator(cpu=True); m = a.prepare(torch.nn.Linear(2, 2)); unwrapped_model(a, m); "
        "print('deepspeed' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_the_learning_rate_function_comes_back_through_accelerates_wrapper():
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)

    def schedule(step: int) -> float:
        return 0.5

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    assert library_seams.lr_lambda(scheduler) is schedule
    assert library_seams.lr_lambda(AcceleratedScheduler(scheduler, optimizer)) is schedule


def test_views_of_one_storage_share_its_key():
    tensor = torch.zeros(4)
    key = library_seams.storage_key(tensor)
    assert isinstance(key, int) and key == library_seams.storage_key(tensor[1:]) == library_seams.storage_key(
        tensor.view(2, 2)
    )
    assert key != library_seams.storage_key(tensor.clone())


def test_a_registered_backend_compiles_the_forward_and_the_backward_graph():
    assert {"inductor", "aot_eager", "eager"} <= set(library_seams.compile_backends())
    seen = []

    def compiler(which: str):
        return lambda graph, example_inputs: seen.append(which) or graph

    library_seams.register_compile_backend("taehv_library_seams_test", compiler("forward"), compiler("backward"))
    assert "taehv_library_seams_test" in library_seams.compile_backends()
    x = torch.ones(2, requires_grad=True)
    torch.compile(lambda v: (v * 3).sum(), backend="taehv_library_seams_test")(x).backward()
    assert seen == ["forward", "backward"] and x.grad.tolist() == [3.0, 3.0]


def test_a_deepspeed_process_group_forgone_the_shm_kernel_compiles_nothing(tmp_path, monkeypatch):
    """What starting DeepSpeed's CPU backend builds (``build_shm_op``, which
    ``TorchBackend.__init__`` calls) is nothing once the kernel is forgone: no C++ compiled
    into ``TORCH_EXTENSIONS_DIR``, no kernel loaded."""
    import deepspeed.ops
    from deepspeed.comm.torch import TorchBackend, build_shm_op

    assert "self.shm_comm_op = build_shm_op()" in inspect.getsource(TorchBackend.__init__)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", True)  # as probed here; put back after
    library_seams.forgo_deepspeed_shm_kernel()
    assert build_shm_op() is None and list(tmp_path.iterdir()) == []


def test_the_zero_optimizer_has_what_the_deepspeed_seams_read():
    from deepspeed.checkpoint import constants
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert "check_grad_overflow" in inspect.signature(DeepSpeedZeroOptimizer.__init__).parameters
    assert "if self.check_grad_overflow:" in inspect.getsource(DeepSpeedZeroOptimizer.step)  # read at each step
    assert isinstance(DeepSpeedZeroOptimizer.loss_scale, property)
    assert (library_seams.LOSS_SCALER, library_seams.PARAM_SLICE_MAPPINGS) == (
        constants.LOSS_SCALER,
        constants.PARAM_SLICE_MAPPINGS,
    )
    inspect.signature(DeepSpeedZeroOptimizer.load_state_dict).bind(
        None, [None], load_optimizer_states=True, load_from_fp32_weights=True
    )


def test_the_overflow_switch_and_the_loss_scale_of_a_zero_optimizer():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer)  # its state alone, no process group
    engine = SimpleNamespace(optimizer=optimizer)
    assert not library_seams.has_overflow_switch(engine)
    library_seams.set_overflow_check(engine, True)
    assert library_seams.has_overflow_switch(engine) and library_seams.overflow_check(engine) is True
    optimizer.custom_loss_scaler, optimizer.loss_scaler = False, DynamicLossScaler(2.0**12, 1000, 1, 0, False)
    assert library_seams.zero_loss_scale(engine) == 2.0**12


def test_the_zero_optimizer_state_keeps_the_loss_scaler_as_plain_values():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    scaler = DynamicLossScaler(2.0**12, 1000, 1, 0, False)
    loaded = []
    zero = SimpleNamespace(
        loss_scaler=scaler,
        state_dict=lambda: {"base": torch.ones(2), "loss_scaler": scaler, "param_slice_mappings": [{"a": object()}]},
        load_state_dict=lambda per_rank, **how: loaded.append((per_rank, how)),
    )
    state = library_seams.zero_optimizer_state(zero)
    assert set(state) == {"base", "loss_scaler_attributes"} and state["loss_scaler_attributes"]["cur_scale"] == 2.0**12
    scaler.cur_scale = 1.0
    library_seams.load_zero_optimizer_state(zero, state, rank=1, world_size=2)
    assert scaler.cur_scale == 2.0**12
    assert loaded == [
        ([None, {"base": state["base"]}], {"load_optimizer_states": True, "load_from_fp32_weights": True})
    ]
