"""Out-of-range option values, one command at a time: each is one ``error:`` line and exit
status 2 before anything is built or written (no run folder, no output folder), through
the command's entry point run in this process (``exit_on_user_error(main, argv)``)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, tool_exit
from taehv_train.common.config import _TYPES, TrainConfig, load_config
from taehv_train.common.config_ranges import RANGES, range_problems
from taehv_train.models.taehv import TAEHV
from taehv_train.models.weights import save_weights
from taehv_train.training import export, taehv_train, which_latents
from taehv_train.training.loop import memory
from train_runs import TEST_CONFIG


def one_error_line(main, argv: list[str], capsys) -> str:
    """The ``error:`` line ``main`` ends in on stderr, asserting exit status 2 and no traceback."""
    status, _, lines = tool_exit(capsys, main, *argv)
    err = "\n".join(lines)
    assert status == 2 and "Traceback" not in err, err
    line = err[err.index("error: ") :].rstrip()
    assert "\n" not in line, err
    return line


def test_every_numeric_key_has_its_range_and_the_defaults_lie_in_them():
    numeric = {name for name, kind in _TYPES.items() if kind in (int, float)}
    assert set(RANGES) == numeric
    assert range_problems(TrainConfig()) == []
    assert range_problems(load_config(TEST_CONFIG)) == []


@pytest.mark.parametrize(
    "override, problem",
    [
        ("--seed=-1", "seed=-1 must be in [0, 4294967295]"),
        ("--seed=100000000000000000000000", "seed=100000000000000000000000 must be in [0, 4294967295]"),
        ("--n_frames=0", "n_frames=0 must be in [1, 1024]"),
        ("--n_frames=1000000", "n_frames=1000000 must be in [1, 1024]"),
        ("--stride_max=5000", "stride_max=5000 must be in [1, 1000]"),
        ("--dataloader_num_workers=100000", "dataloader_num_workers=100000 must be in [0, 256]"),
        ("--prefetch_batches=1000000000", "prefetch_batches=1000000000 must be in [1, 64]"),
        ("--train_batch_size=0", "train_batch_size=0 must be in [1, 4096]"),
        ("--learning_rate=0", "learning_rate=0.0 must be in (0, 1]"),
        ("--adam_beta1=1.5", "adam_beta1=1.5 must be in [0, 1)"),
        ("--encoder_loss_weight=-1", "encoder_loss_weight=-1.0 must be >= 0"),
        ("--validations_per_budget=1000000", "validations_per_budget=1000000 must be in [0, 1000]"),
        ("--max_failure_fraction=2", "max_failure_fraction=2.0 must be in [0, 1]"),
        ("--crop_scale_min=0", "crop_scale_min=0.0 must be in (0, 1]"),
    ],
)
def test_training_refuses_an_out_of_range_value_before_any_run_folder(tmp_path, capsys, override, problem):
    out = tmp_path / "out"
    line = one_error_line(taehv_train.main, ["--config", TEST_CONFIG, f"--output_dir={out}", override], capsys)
    assert line == f"error: invalid config: {problem}"
    assert not out.exists()


def demo_run(clips: dict, out: Path, *overrides: str) -> list[str]:
    return [
        "--config",
        TEST_CONFIG,
        f"--output_dir={out}",
        f"--data_root={clips['root']}",
        f"--annotation_file={clips['train']}",
        f"--val_annotation_file={clips['val']}",
        *overrides,
    ]


def test_prefetched_batches_beyond_the_machines_ram_are_refused_with_the_most_that_fits(
    tmp_path, capsys, demo_clips, monkeypatch
):
    """The loaders' batches count against RAM: each training process keeps
    ``prefetch_batches`` received and ``prefetch_factor`` per worker prepared."""
    config = load_config(TEST_CONFIG)
    batch = config.n_frames * 3 * config.height * config.width  # uint8 frames of one clip (train_batch_size 1)
    monkeypatch.setattr(memory, "host_memory", lambda: 10 * batch)  # room for 10 batches
    out = tmp_path / "out"
    argv = demo_run(demo_clips, out, "--prefetch_batches=64", "--dataloader_num_workers=2", "--prefetch_factor=4")
    line = one_error_line(taehv_train.main, argv, capsys)
    assert line.startswith("error: prefetch_batches=64 and prefetch_factor=4 x 2 dataloader_num_workers keep 72 ")
    assert line.endswith("set prefetch_batches to at most 2") and not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 mixed precision on a CPU")
def test_fp16_mixed_precision_without_a_gpu_is_refused(tmp_path, capsys, demo_clips):
    out = tmp_path / "out"
    line = one_error_line(taehv_train.main, demo_run(demo_clips, out, "--mixed_precision=fp16"), capsys)
    assert line.startswith("error: mixed_precision=fp16 needs a GPU: on a CPU it would train in fp32; use ")
    assert not out.exists()


@pytest.fixture(scope="module")
def inference_main():
    return runpy.run_path(str(REPO_ROOT / "inference.py"))["main"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seed", "-5"], "--seed=-5 must be in [0, 4294967295]"),
        (["--fps", "-5"], "--fps=-5.0 must be in (0, 1000]"),
        (["--fps", "nan"], "--fps=nan must be in (0, 1000]"),
        (["--n_frames", "100000"], "--n_frames=100000 must be in [1, 1024]"),
        (["--stride", "0"], "--stride=0 must be in [1, 1000]"),
        (["--height", "-64"], "--height=-64 must be in [1, 16384]"),
        (["--device", "bogus"], "--device 'bogus' is not a device name; this machine has: cpu"),
        (["--device", "gpu"], "--device 'gpu' is not a device name; this machine has: cpu"),
        (["--device", "cpu:-1"], "--device 'cpu:-1' is not a device name; this machine has: cpu"),
        (["--device", "meta"], "--device 'meta' is not usable on this machine; this machine has: cpu"),
        pytest.param(
            ["--device", "mps"],
            "--device 'mps' is not usable on this machine; this machine has: cpu",
            marks=pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS"),
        ),
        pytest.param(
            ["--device", "cuda"],
            "--device 'cuda' is not usable on this machine; this machine has: cpu",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
        ),
    ],
)
def test_inference_refuses_an_out_of_range_value_before_any_output_folder(
    tmp_path, capsys, inference_main, args, message
):
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        message = message.split("; this machine has")[0]
    out = tmp_path / "results"
    argv = ["--model_path", str(tmp_path / "model.pth"), "--videos", str(tmp_path), "--output_dir", str(out), *args]
    line = one_error_line(inference_main, argv, capsys)
    assert line.startswith(f"error: {message}") and not out.exists()


def text(content: str):
    """A writer of a text file: to torch.load, bytes of pickle opcodes it fails on in one way or another."""
    return lambda path: path.write_text(content)


def write_folder(path: Path) -> None:
    path.mkdir()


def write_empty(path: Path) -> None:
    torch.save(torch.zeros(1, 16, 0, 4, 4), path)


def write_nan(path: Path) -> None:
    latents = torch.randn(1, 16, 2, 4, 4)
    latents[0, 3, 1, 2, 2] = float("nan")
    torch.save(latents, path)


@pytest.mark.parametrize(
    "name, write, message",
    [
        ("h.pt", text("hello world\n"), "h.pt is not a readable PyTorch weight file (damaged or truncated): 101"),
        ("x.pt", text("epoch 1 loss 0.25\n"), "x.pt is not a readable PyTorch weight file (damaged or truncated): pop"),
        ("y.pt", text("notes\n"), "y.pt is damaged or holds objects other than tensors"),
        ("x.pth", write_folder, "x.pth is a folder, not a file"),
        ("empty.pt", write_empty, "empty.pt holds an empty tensor (1, 16, 0, 4, 4)"),
        ("nan.pt", write_nan, "nan.pt holds NaN or infinite values"),
    ],
)
def test_which_latents_refuses_what_holds_no_latents(tmp_path, capsys, name, write, message):
    write(tmp_path / name)
    line = one_error_line(which_latents.main, [str(tmp_path / name), "--ref_vae_class=wan"], capsys)
    assert line.startswith(f"error: {tmp_path}/{message}")


def test_export_refuses_an_empty_out_instead_of_writing_into_the_current_folder(tmp_path, capsys, monkeypatch):
    weights = save_weights(TAEHV(variant="taehv"), tmp_path / "taehv.pth")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    line = one_error_line(export.main, [str(weights), "--out", ""], capsys)
    assert line == "error: --out is empty: name the folder to write the bundle into"
    assert not any(here.iterdir())
