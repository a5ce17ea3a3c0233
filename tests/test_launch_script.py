"""train_taehv_h100.sh: help, argument errors, pre-flight checks and a real CPU launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT
from train_runs import one_line_error

pytestmark = pytest.mark.slow  # the launch script starts training

SCRIPT = str(REPO_ROOT / "train_taehv_h100.sh")


def launch(
    *args: str, env: dict | None = None, timeout: int = 180, cwd: Path = REPO_ROOT
) -> subprocess.CompletedProcess:
    """The launch script run from ``cwd`` (the repository unless given), as a user types it."""
    environment = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(
        ["bash", SCRIPT, *args], capture_output=True, text=True, cwd=cwd, env=environment, timeout=timeout
    )


def data_options(clips: dict) -> list[str]:
    return [
        f"--data_root={clips['root']}",
        f"--annotation_file={clips['train']}",
        f"--val_annotation_file={clips['val']}",
    ]


# the smallest training step: two latent frames at 16x16 (the test preset's is 9 frames at 32x32)
TINY = ("--n_frames=5", "--height=16", "--width=16")

# the from-scratch preset at the smallest step: two steps on the demo clips, validation included
TINY_SCRATCH = (
    *TINY,
    "--train_batch_size=1",
    "--mixed_precision=no",
    "--frame_cache_mb=0",
    "--dataloader_num_workers=0",
    "--max_train_steps=2",
    "--checkpointing_steps=2",
    "--validation_every=2",
    "--num_validation_samples=1",
    "--log_every=1",
)


def only_error_line(result: subprocess.CompletedProcess) -> str:
    """A refusal: exit 2, no traceback, and stderr is the one line ``error: ...``."""
    line = one_line_error(result)
    assert result.stderr.splitlines() == [line] and line.startswith("error: "), result.stderr
    return line


def test_help():
    result = launch("--help")
    assert result.returncode == 0
    for word in ("NUM_GPUS", "CONFIG_TYPE", "--resume", "--debug", "--profile", "MASTER_ADDR", "NODE_RANK"):
        assert word in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "Usage"),
        (("8",), "need NUM_GPUS and CONFIG_TYPE"),
        (("x", "test"), "NUM_GPUS must be a positive integer"),
        (("1", "h200"), "unknown CONFIG_TYPE 'h200'"),
        (("1", "custom"), "custom needs a config path"),
        (("1", "custom", "nowhere.py"), "config file nowhere.py not found"),
        (("1", "test", "stray"), "unexpected argument 'stray'"),
        (("1", "test", "--resume"), "--resume needs"),
        (("1", "test", "--n_frame=9"), "did you mean 'n_frames'"),
        (("1", "test", "--resme", "latest"), "unexpected argument '--resme'; did you mean --resume?"),
    ],
)
def test_argument_errors(args, message):
    result = launch(*args)
    if args:
        assert message in only_error_line(result)
    else:
        assert result.returncode == 2 and message in result.stdout


def test_rank_without_nnodes_is_refused():
    result = launch("16", "test", env={"RANK": "1"})
    assert result.returncode == 2 and "set NNODES" in result.stderr


@pytest.fixture(scope="module")
def test_preset_run(tmp_path_factory, demo_clips) -> tuple[subprocess.CompletedProcess, Path]:
    """The test preset launched on one CPU process, 2 steps at the smallest step, as the run
    named base: the launch's output and the run's folder (its output_dir holds nothing else)."""
    out = tmp_path_factory.mktemp("test_preset") / "out"
    overrides = (f"--output_dir={out}", "--run_name=base", *TINY, "--max_train_steps=2")
    return launch("1", "test", *data_options(demo_clips), *overrides), out / "base"


def test_cpu_launch_runs_training(test_preset_run):
    result, run = test_preset_run
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "[ok] config" in result.stdout and "launch:" in result.stdout
    assert list(run.parent.iterdir()) == [run]
    assert (run / "final_model.pth").is_file()


def test_data_root_alone_scans_that_folder_instead_of_the_presets_annotations(tmp_path, demo_clips):
    """The scratch preset's annotation files lie in its own data folder: --data_root=DIR
    alone trains on DIR's clips, without a validation set, and a note says how to make one."""
    result = launch("1", "scratch", f"--data_root={demo_clips['root']}", f"--output_dir={tmp_path}", *TINY_SCRATCH)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert f"note: no annotation file: training scans data_root {demo_clips['root']} for clips" in result.stdout
    assert f"python -m taehv_train.training.make_annotations {demo_clips['root']} -o" in result.stdout
    (run,) = tmp_path.iterdir()
    config = json.loads((run / "config.json").read_text())
    assert (config["data_root"], config["annotation_file"], config["val_annotation_file"]) == (
        str(demo_clips["root"]),
        "",
        "",
    )
    assert "training clips: 6" in (run / "train.log").read_text()


def test_custom_config_path(tmp_path):
    config = tmp_path / "my_config.py"
    config.write_text(
        "from taehv_train.training.configs.taehv_config_test import config as base\n"
        "config = base.replace(data_root='/definitely/missing', annotation_file='', val_annotation_file='')\n"
    )
    result = launch("1", "custom", str(config))
    assert "/definitely/missing does not exist" in only_error_line(result)


def test_a_gpu_preset_without_its_files_says_how_to_get_each(tmp_path):
    """Each missing file or folder of a GPU preset comes with the command that fetches it
    (or, for the data, the flag that trains on one's own clips), before anything starts."""
    checkpoints, data = tmp_path / "checkpoints", tmp_path / "data" / "MiniDataset"  # the preset's names
    result = launch(
        "1",
        "1gpu_h100",
        f"--output_dir={tmp_path / 'output'}",
        f"--data_root={data}",
        f"--pretrained_model_path={checkpoints / 'taecvx.pth'}",
        f"--ref_vae_path={checkpoints / 'CogVideoX-2b'}",
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    for line in (
        f"data_root: {data} does not exist: to train on your own clips, add "
        "--data=DIR (a folder of videos) to ./train_taehv_h100.sh",
        f"pretrained_model_path: {checkpoints / 'taecvx.pth'} does not exist; fetch it with `curl -L --fail "
        f"--create-dirs -o {checkpoints / 'taecvx.pth'} https://github.com/madebyollin/taehv/raw/main/taecvx.pth` "
        "(checkpoints/README.md)",
        f"ref_vae_path: {checkpoints / 'CogVideoX-2b'} does not exist; fetch it with `hf download THUDM/CogVideoX-2b "
        f"--include 'vae/*' --local-dir {checkpoints / 'CogVideoX-2b'}` (checkpoints/README.md)",
    ):
        assert f"  {line}\n" in result.stderr, result.stderr
    assert not (tmp_path / "output").exists()


def test_a_key_typo_in_a_custom_config_file_is_one_line(tmp_path):
    config = tmp_path / "my_config.py"
    config.write_text(
        "from taehv_train.training.configs.taehv_config_test import config as base\n"
        "config = base.replace(lerning_rate=3e-4)\n"
    )
    result = launch("1", "custom", str(config))
    assert only_error_line(result).endswith(
        "my_config.py:2: unknown config key 'lerning_rate'; did you mean 'learning_rate'?"
    )


def test_an_empty_data_folder_is_refused_before_a_run_folder_exists(tmp_path):
    (tmp_path / "empty").mkdir()
    result = launch(
        "1",
        "scratch",
        f"--output_dir={tmp_path / 'out'}",
        f"--data_root={tmp_path / 'empty'}",
        "--annotation_file=",
        "--val_annotation_file=",
    )
    assert "empty holds no videos or images" in only_error_line(result) and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("--height=0",), "error: invalid config: height=0 must be in [1, 16384]"),
        (("--height=0", "--width=0"), "error: invalid config:"),  # several problems: one line each below it
        (("--resume", "checkpoint-3"), "error: --resume checkpoint-3: no run of this config under"),
    ],
)
def test_a_pre_flight_refusal_is_one_error_line_on_stderr(tmp_path, demo_clips, overrides, message):
    result = launch("1", "test", f"--output_dir={tmp_path / 'out'}", *data_options(demo_clips), *overrides)
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr
    first, *more = result.stderr.splitlines()
    assert first.startswith(message) and all(line.startswith("  ") for line in more), result.stderr
    assert len(more) == (2 if "--width=0" in overrides else 0)
    assert "launch:" not in result.stdout and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def cpu_launches(tmp_path_factory, demo_clips) -> tuple[int, dict[str, subprocess.CompletedProcess]]:
    """The cores this process may use, and by preset two CPU launches the config check stops
    after the warnings: scratch (a CPU preset) on as many processes as cores, h100 (a GPU
    preset) on one more."""
    cores, out = len(os.sched_getaffinity(0)), tmp_path_factory.mktemp("cpu_launches")
    return cores, {
        preset: launch(str(processes), preset, f"--output_dir={out}", *data_options(demo_clips), "--height=0")
        for preset, processes in (("scratch", cores), ("h100", cores + 1))
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning of a CPU launch")
def test_only_the_gpu_presets_are_called_gpu_presets_on_a_cpu(cpu_launches):
    """scratch is the CPU demo's recipe (docs/training.md); h100 is sized for GPUs."""
    _, launches = cpu_launches
    for preset, warned in (("scratch", False), ("h100", True)):
        result = launches[preset]
        assert result.returncode == 2, result.stderr
        assert ("h100 is sized for GPUs: on a CPU use scratch, demo or test" in result.stdout) == warned, result.stdout
        assert "GPU preset" not in result.stdout and (("sized for GPUs" in result.stdout) == warned)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning of a CPU launch")
def test_more_processes_than_cpu_cores_are_warned_about(cpu_launches):
    cores, launches = cpu_launches
    for preset, warned in (("scratch", False), ("h100", True)):  # cores processes, then one more
        result = launches[preset]
        assert result.returncode == 2, result.stderr  # stopped by the config check, after the warnings
        expected = f"{cores + 1} processes on {cores} CPU core(s): they share the cores"
        assert (expected in result.stdout) == warned, result.stdout
        assert ("CPU core(s): they share the cores" in result.stdout) == warned, result.stdout


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_a_resume_under_another_preset_or_into_another_folder_is_refused_before_anything_is_written(
    tmp_path, demo_clips, test_preset_run
):
    """A checkpoint continues its own run, in its folder, under the preset that started it:
    another preset or an --output_dir elsewhere is one error line (exit 2) that names both
    ways on, and so is a weight file given to --resume; no new folder is made and the run
    (final model, config.json, lock, checkpoints) is as it was. The same preset with a
    key=value change resumes, and the weights the message names start a new run."""
    started, run = test_preset_run
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-4000:]
    data, new = data_options(demo_clips), tmp_path / "new"
    checkpoint, weights = (
        run / "checkpoints" / "checkpoint-2",
        run / "checkpoints" / "checkpoint-2" / "weights.safetensors",
    )
    before = snapshot(run)
    ways_on = (
        "Resume with the test preset (--key=value changes allowed) and no other --output_dir/--run_name, or start "
        f"a new run from its weights with --pretrained_model_path={weights}"
    )
    for preset, overrides, conflict in (
        ("demo", [f"--output_dir={new}"], f"uses the demo preset and gives --output_dir={new}"),
        ("test", [f"--output_dir={new}"], f"gives --output_dir={new}"),
    ):
        line = only_error_line(
            launch("1", preset, *data, *overrides, "--max_train_steps=4", "--resume", str(checkpoint))
        )
        assert line.startswith(
            f"error: {checkpoint} belongs to the run {run}, started with the test preset, but this command {conflict}: "
        )
        assert line.endswith(ways_on)
        assert not new.exists() and snapshot(run) == before
    final_model = run / "final_model.safetensors"
    line = only_error_line(launch("1", "test", *data, "--resume", str(final_model)))
    assert line == (
        f"error: --resume {final_model}: {final_model} is a weight file, not a checkpoint folder: start a new run "
        f"from these weights with --pretrained_model_path={final_model}, or continue its run with --resume {checkpoint}"
    )
    assert snapshot(run) == before

    resumed = launch("1", "test", *data, "--max_train_steps=4", "--resume", str(checkpoint))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    assert f"resumed from {checkpoint} at step 2" in (run / "train.log").read_text()
    assert (run / "checkpoints" / "checkpoint-4").is_dir()
    fresh = launch(
        "1", "test", *data, f"--output_dir={new}", f"--pretrained_model_path={weights}", *TINY, "--max_train_steps=1"
    )
    assert fresh.returncode == 0, fresh.stdout[-2000:] + fresh.stderr[-4000:]
    (new_run,) = new.iterdir()
    assert f"initialised from {weights}" in (new_run / "train.log").read_text()


def test_an_ending_training_chose_wins_over_a_process_that_dies_on_its_way_out(monkeypatch):
    """Every rank refused the run in one line (status 2), then one aborted in a library's exit
    handlers before the other exited: the launcher exits 2, without a 'rank died' line."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from taehv_train.training import launch

    def refused_then_aborted(args) -> None:
        Path(os.environ["TAEHV_EXIT_STATUS_FILE"]).write_text("2\n")
        aborted = ProcessFailure(local_rank=1, pid=2, exitcode=-6, error_file="")
        refused = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file="")
        aborted.timestamp, refused.timestamp = 1, 2  # the abort was seen first
        raise ChildFailedError("taehv_train.training.taehv_train", {0: refused, 1: aborted})

    monkeypatch.setattr(launch, "launch_command", refused_then_aborted)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    with pytest.raises(SystemExit) as ended:
        launch.main(["--num_processes", "2", "-m", "taehv_train.training.taehv_train", "--config", "c.py"])
    assert ended.value.code == 2
