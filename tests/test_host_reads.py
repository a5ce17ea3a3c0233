"""How often training makes the host wait for the device: the device-to-host reads
(``Tensor.item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``, ``cpu``,
``numpy``) that project code makes on the training thread, counted per optimizer step of a
real one-process run (docs/training.md, "Every GPU-second trains")."""

from __future__ import annotations

import functools
import sys
import threading
from collections import Counter

import torch

from taehv_train.common.config import REPO_ROOT
from taehv_train.training.loop.step import TrainStep
from train_runs import train_here

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")
READS_PER_STEP = 1  # the window's settled flags (training.loop.resilience.WindowTrouble.settle)


def project_caller() -> str | None:
    """``file:line`` of the project code that called the read, or None (libraries, tests, other threads)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    frame = sys._getframe(2)
    path = frame.f_code.co_filename
    inside = path.startswith(str(REPO_ROOT)) and not path.startswith(str(REPO_ROOT / ".venv"))
    if not inside or path.startswith(str(REPO_ROOT / "tests")):
        return None
    return f"{path.removeprefix(str(REPO_ROOT) + '/')}:{frame.f_lineno}"


def test_a_training_step_reads_from_the_device_at_most_once(tmp_path, demo_clips, monkeypatch):
    """Windows of 2 micro-batches; no log, validation or checkpoint before the last step, so
    each window's count is what the step and the loop's bookkeeping cost between two windows."""
    reads: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            if (caller := project_caller()) is not None:
                reads.append(caller)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, functools.wraps(original)(counted))
    window_starts: list[int] = []
    call = TrainStep.__call__

    def window(self, batches, number):
        window_starts.append(len(reads))
        return call(self, batches, number)

    monkeypatch.setattr(TrainStep, "__call__", window)
    steps = 5
    train_here(
        tmp_path,
        demo_clips,
        f"--max_train_steps={steps}",
        "--gradient_accumulation_steps=2",
        "--log_every=100",
        "--validation_every=100",
        "--checkpointing_steps=100",
        "--n_frames=5",  # two latent frames: the same step as the config's 9 frames, for less compute
    )
    assert len(window_starts) == steps
    for first, after in zip(window_starts, window_starts[1:]):
        per_window = Counter(reads[first:after])
        assert sum(per_window.values()) <= READS_PER_STEP, per_window
    assert sum(Counter(reads[window_starts[0] : window_starts[-1]]).values()) == steps - 1  # the one read is there
