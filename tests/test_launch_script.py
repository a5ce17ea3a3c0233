"""train_taehv_h100.sh: help, argument errors, pre-flight checks and a real CPU launch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from training.demo_data import make_demo_dataset

pytestmark = pytest.mark.slow  # the launch script starts training

SCRIPT = str(REPO_ROOT / "train_taehv_h100.sh")


def launch(*args: str, env: dict | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(
        ["bash", SCRIPT, *args], capture_output=True, text=True, cwd=REPO_ROOT, env=environment, timeout=timeout
    )


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
    ],
)
def test_argument_errors(args, message):
    result = launch(*args)
    assert result.returncode == 2
    assert message in result.stdout + result.stderr


def test_rank_without_nnodes_is_refused():
    result = launch("16", "test", env={"RANK": "1"})
    assert result.returncode == 2 and "set NNODES" in result.stderr


def test_cpu_launch_runs_training(tmp_path):
    paths = make_demo_dataset(tmp_path / "data", num_clips=4, n_frames=12, height=48, width=64)
    result = launch(
        "1",
        "test",
        f"--output_dir={tmp_path / 'out'}",
        f"--data_root={tmp_path / 'data'}",
        f"--annotation_file={paths['train']}",
        f"--val_annotation_file={paths['val']}",
        "--max_train_steps=2",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "[ok] config" in result.stdout and "launch:" in result.stdout
    (run,) = (tmp_path / "out").iterdir()
    assert (run / "final_model.pth").is_file()


def test_custom_config_path(tmp_path):
    config = tmp_path / "my_config.py"
    config.write_text(
        "from training.configs.taehv_config_test import config as base\n"
        "config = base.replace(data_root='/definitely/missing')\n"
    )
    result = launch("1", "custom", str(config))
    assert result.returncode == 2 and "/definitely/missing does not exist" in result.stderr


def test_a_key_typo_in_a_custom_config_file_is_one_line(tmp_path):
    config = tmp_path / "my_config.py"
    config.write_text(
        "from training.configs.taehv_config_test import config as base\nconfig = base.replace(lerning_rate=3e-4)\n"
    )
    result = launch("1", "custom", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr
    assert (
        "my_config.py:2: unknown config key 'lerning_rate'; did you mean 'learning_rate'?"
        in result.stdout + result.stderr
    )
