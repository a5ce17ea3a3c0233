"""The launch script's command line, its presets and the pre-flight it runs once per launch,
without starting anything (tests/test_launch_script.py runs the script itself)."""

from __future__ import annotations

import json
import re

import pytest

from conftest import REPO_ROOT
from taehv_train.common.presets import BASE, CONFIGS_DIR, preset_file, preset_names, preset_of
from taehv_train.training import launch_check
from taehv_train.training.launch_args import DEBUG, LaunchArgs, LaunchRefused, parse
from taehv_train.training.launch_script import Terminal, accelerate_config, launch_command, processes_per_node

TEST_PRESET = "training/configs/taehv_config_test.py"


def test_the_presets_are_the_files_of_the_configs_folder():
    files = sorted(p.stem for p in (REPO_ROOT / "training" / "configs").glob(f"{BASE}_*.py"))
    assert [f"{BASE}_{name}" for name in preset_names()] == files
    assert {"test", "h100", "scratch"} <= set(preset_names())
    assert preset_of(preset_file("h100")) == "h100" and preset_file("h100").is_file()
    assert preset_of(CONFIGS_DIR / f"{BASE}.py") is None  # the base is no preset
    assert preset_of(REPO_ROOT / "taehv_config_h100.py") is None  # a file of that name elsewhere is a custom config


def test_a_preset_and_its_overrides(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    args = parse(["2", "test", "--learning_rate=3e-4", "--debug", "--resume=latest"], REPO_ROOT)
    assert (args.num_gpus, args.config_type, args.config) == (2, "test", TEST_PRESET)
    assert args.extra == ["--learning_rate=3e-4", *DEBUG, "--resume_from_checkpoint=latest"] and args.debug
    assert args.typed == ["2", "test", "--learning_rate=3e-4", "--debug", "--resume=latest"]


def test_typed_paths_are_taken_from_the_callers_folder_when_they_exist_there(monkeypatch, tmp_path):
    """A path that exists where the user ran the script is made absolute from there (also in
    the command training prints back); one that does not is left for the repository."""
    monkeypatch.chdir(REPO_ROOT)
    (tmp_path / "videos").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "my_config.py").write_text("")
    args = parse(
        ["1", "custom", "my_config.py", "--data", "videos", "--resume", "run", "--ref_vae_path=nowhere", "--x_dir=run"],
        tmp_path,
    )
    assert args.config == f"{tmp_path}/my_config.py" and args.data == f"{tmp_path}/videos"
    assert args.extra == [
        f"--resume_from_checkpoint={tmp_path}/run",
        "--ref_vae_path=nowhere",
        f"--x_dir={tmp_path}/run",
    ]
    assert args.typed == [
        "1",
        "custom",
        f"{tmp_path}/my_config.py",
        f"--data={tmp_path}/videos",
        "--resume",
        f"{tmp_path}/run",
        "--ref_vae_path=nowhere",
        f"--x_dir={tmp_path}/run",
    ]
    assert parse(["1", "test", "--data=videos"], tmp_path).typed[-1] == f"--data={tmp_path}/videos"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["1", "test", "--dat", "x"], "unexpected argument '--dat'; did you mean --data?"),
        (["1", "test", "--profil"], "unexpected argument '--profil'; did you mean --profile?"),
        (["1", "test", "--zzz"], "unexpected argument '--zzz' (overrides look like --key=value; see --help)"),
        (["1", "test", "--data"], "--data needs a folder of videos"),
        (["0", "test"], "NUM_GPUS must be a positive integer, got '0'"),
    ],
)
def test_command_line_mistakes(monkeypatch, argv, message):
    monkeypatch.chdir(REPO_ROOT)
    with pytest.raises(LaunchRefused) as refused:
        parse(argv, REPO_ROOT)
    assert str(refused.value).startswith(message)


def test_the_accelerate_config_and_the_processes_of_a_node(monkeypatch):
    assert [accelerate_config(1, 1), accelerate_config(8, 1), accelerate_config(16, 2)] == [
        "accelerate_configs/deepspeed_1gpu.yaml",
        "accelerate_configs/deepspeed_8gpu.yaml",
        "accelerate_configs/deepspeed_16gpu.yaml",
    ]
    assert all((REPO_ROOT / accelerate_config(n, nodes)).is_file() for n, nodes in ((1, 1), (8, 1), (16, 2)))
    monkeypatch.setenv("NNODES", "2")
    assert processes_per_node(16) == 8
    monkeypatch.setenv("NNODES", "3")
    assert processes_per_node(16) == 16  # refused later, by the node check


def test_one_node_meets_on_a_free_port_and_several_nodes_on_the_agreed_one(monkeypatch):
    """Two jobs on one machine must not both ask for 29500; nodes must all use one port."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "node1")

    def port(gpus: int, nodes: int) -> int:
        command = launch_command(Terminal(), "python", LaunchArgs(2, "test", TEST_PRESET), gpus, nodes, 0)
        return int(command[command.index("--main_process_port") + 1])

    cpu, one_node = port(0, 1), port(8, 1)
    assert 29500 not in (cpu, one_node)  # a port the kernel found free, not the fixed default
    assert port(8, 2) == 29500
    monkeypatch.setenv("MASTER_PORT", "29611")
    assert port(0, 1) == port(8, 1) == port(8, 2) == 29611


def test_training_logs_the_launch_checks_notes_and_checks_for_itself_otherwise(monkeypatch):
    """A training process of the launch script takes the notes of the pre-flight the script
    ran; one started otherwise runs the pre-flight."""
    from taehv_train.training import preflight

    ran = []
    monkeypatch.setattr(preflight, "notes_of", lambda config: ran.append(config) or ["its own note"])
    monkeypatch.delenv(launch_check.CHECKED_NOTES, raising=False)
    assert launch_check.training_notes("config") == ["its own note"] and ran == ["config"]
    monkeypatch.setenv(launch_check.CHECKED_NOTES, json.dumps(["the launch's note"]))
    assert launch_check.training_notes("config") == ["the launch's note"] and ran == ["config"]


def test_the_pre_flight_counts_the_processes_the_launch_starts_on_this_machine(monkeypatch, demo_clips):
    """Frame caches that fit one process's share of the RAM but not four: refused by the
    pre-flight of a 4-process launch, as each of its training processes would refuse them."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # restored after the check sets it
    data = [f"--data_root={demo_clips['root']}", f"--annotation_file={demo_clips['train']}"]
    options = [
        *data,
        f"--val_annotation_file={demo_clips['val']}",
        "--dataloader_num_workers=0",
        "--prefetch_batches=1",
    ]
    from taehv_train.training.loop.memory import host_memory

    share = host_memory() // 2**20 // 3  # a third of the RAM for each process's frame cache
    one = launch_check.checked(str(REPO_ROOT / TEST_PRESET), [*options, f"--frame_cache_mb={share}"], 1)
    assert not one.error and not one.crash, one.error + one.crash
    four = launch_check.checked(str(REPO_ROOT / TEST_PRESET), [*options, f"--frame_cache_mb={share}"], 4)
    assert four.error.startswith("error: frame_cache_mb=") and "x 4 training process(es) on this machine" in four.error


def test_the_docs_preset_table_names_every_preset():
    """docs/training.md's table of presets names each preset file once, and nothing else."""
    text = (REPO_ROOT / "docs" / "training.md").read_text()
    table = text[text.index("| preset | what it is |") :].split("\n\n")[0]
    named = [name for row in table.splitlines()[2:] for name in re.findall(r"`(\w+)`", row.split(" | ")[0])]
    assert sorted(named) == preset_names()
