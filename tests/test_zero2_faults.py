"""The GPU path's faults under 2-process DeepSpeed ZeRO-2 (gloo on CPU), bf16 weights,
compiled (torch.compile with aot_eager, a CPU backend whose results are the eager ones):

- every window that some rank could not train (out of memory in the forward pass, the
  backward pass or the copy to the device; a NaN loss; a backward compilation that fails)
  is skipped on both ranks and leaves the weights, the EMA weights, every rank's optimizer
  state and the schedule exactly as a run that never saw it, with DeepSpeed's own overflow
  check switched off;
- a backward compilation that fails on one rank leaves both ranks eager;
- out of memory in the optimizer step ends the run in one line (exit 4) with the resume
  command, and the compiled run resumed from there ends bit-identical to the uninterrupted
  one (SIGTERM stops of ZeRO-2 runs and their resumes: tests/test_fault_tolerance.py).

Every window trains the same clip (one clip listed twice, one per rank; whole frames, no
flip, stride 1, as many frames as the clip has), so a run whose first windows were skipped
trains exactly what a run without them trains. The clip is small (5 frames of 16x16):
bf16 convolutions are slow on a CPU without native bf16.
"""

from __future__ import annotations

import json

import pytest
import torch

from taehv_train.training.demo_data import make_demo_dataset
from taehv_train.training.state.run_folders import list_checkpoints
from taehv_train.training.state.serialisation import load_tree
from train_runs import assert_identical, tensors, train, wrapped_zero2

pytestmark = pytest.mark.slow  # training processes

STEPS = 3
SKIPPED = "compile_backward@1:1,oom@2:1,nan_loss@3:0,oom_backward@4:1,oom_copy@5:0"
COMMON = [
    "--run_name=run",
    "--n_frames=5",  # the clip's length: one window of frames
    "--height=16",
    "--width=16",  # the clip's size: the crop is the whole frame
    "--crop_scale_min=1",
    "--hflip=false",
    "--stride_max=1",
    "--mixed_precision=bf16",
    "--compile=true",
    "--compile_backend=aot_eager",
    f"--max_train_steps={STEPS}",
    "--checkpointing_steps=1",
    "--checkpoints_total_limit=3",
    "--max_consecutive_skipped_steps=10",
    "--validation_every=100",
    "--use_ema=true",  # the EMA weights are part of the state a skipped window leaves untouched
]


@pytest.fixture(scope="module")
def one_clip(tmp_path_factory) -> dict:
    """A demo clip of 5 frames of 16x16 listed twice (a sample per rank, the same each
    epoch), and another one to validate on."""
    root = tmp_path_factory.mktemp("one_clip")
    paths = make_demo_dataset(root, num_clips=2, n_frames=5, height=16, width=16, seed=1)
    listing = json.loads(paths["train"].read_text())
    listing["list"] = listing["list"] * 2
    listing["total"] = 2
    paths["train"].write_text(json.dumps(listing))
    return {"root": root, **paths}


@pytest.fixture(scope="module")
def uninterrupted(one_clip, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    train(wrapped_zero2(29651), out, one_clip, *COMMON)
    return out / "run"


def assert_same_state(left, right, step: int) -> None:
    """Bit-identical final weights and checkpoint ``step``: weights, EMA, every rank's
    optimizer partition, schedule."""
    assert_identical(left / "final_model.safetensors", right / "final_model.safetensors")
    a, b = left / f"checkpoints/checkpoint-{step}", right / f"checkpoints/checkpoint-{step}"
    for name in ("model.safetensors", "weights.safetensors"):
        assert_identical(a / name, b / name)
    for tree in ("optimizer_rank0", "optimizer_rank1", "ema", "scheduler"):
        assert_equal_trees(load_tree(a / tree), load_tree(b / tree), tree)


def assert_equal_trees(left, right, where: str) -> None:
    if isinstance(left, torch.Tensor):
        assert torch.equal(left, right), where
    elif isinstance(left, dict):
        assert left.keys() == right.keys(), where
        for key in left:
            assert_equal_trees(left[key], right[key], f"{where}.{key}")
    elif isinstance(left, list | tuple):
        assert len(left) == len(right), where
        for i, (a, b) in enumerate(zip(left, right)):
            assert_equal_trees(a, b, f"{where}[{i}]")
    else:
        assert left == right, where


def test_skipped_windows_leave_the_state_of_a_run_that_never_saw_them(one_clip, uninterrupted, tmp_path):
    result = train(
        wrapped_zero2(29652), tmp_path, one_clip, *COMMON, f"--fault_injection={SKIPPED},no_overflow_check@1"
    )
    log = (tmp_path / "run" / "train.log").read_text()
    reasons = [
        "torch.compile failed in the backward pass",
        "out of memory (2 in a row",
        "non-finite loss (3 in a row",
        "out of memory (4 in a row",
        "out of memory (5 in a row",
    ]
    for reason in reasons:
        assert f"step 1 skipped on every rank: {reason}" in log, reason
    assert "lower train_batch_size" in log  # the memory advice
    assert result.stderr.count("running eager from now on") == 2  # rank 1's failure, rank 0 told at the window's end
    assert "on another rank" in result.stderr
    assert_same_state(uninterrupted, tmp_path / "run", STEPS)
    final = tensors(tmp_path / "run" / "final_model.safetensors")
    assert all(bool(t.isfinite().all()) for t in final.values())


def test_out_of_memory_in_the_optimizer_step_ends_in_one_line_and_the_compiled_run_resumes_exactly(
    one_clip, uninterrupted, tmp_path
):
    ended = train(wrapped_zero2(29653), tmp_path, one_clip, *COMMON, "--fault_injection=oom_step@2:1", expect=4)
    line = next(line for line in ended.stderr.splitlines() if line.startswith("error: rank 1 ended with status 4"))
    assert "out of memory in its optimizer step" in line and "--resume latest" in line
    assert "Traceback" not in ended.stderr
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [p.name for p in list_checkpoints(checkpoints)] == ["checkpoint-1"]  # nothing after it

    train(wrapped_zero2(29655), tmp_path, one_clip, *COMMON, "--resume=latest")
    assert "resumed from " in (tmp_path / "run" / "train.log").read_text()
    assert_same_state(uninterrupted, tmp_path / "run", STEPS)
