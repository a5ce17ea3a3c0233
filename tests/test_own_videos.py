"""A user's own run, start to finish, through ./train_taehv_h100.sh: a resume continues
from the run's saved config (its data and step count need not be typed again, changes
typed on the resume line are listed), and `--resume latest` never touches a finished run
(one is extended only by path, and says so). One chain of tiny runs serves every test."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_launch_script import SCRIPT, TINY, TINY_SCRATCH, data_options, launch, only_error_line, snapshot

from conftest import REPO_ROOT
from train_runs import TEST_CONFIG, assert_identical, train_here

pytestmark = pytest.mark.slow  # the launch script starts training


def succeeded(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return result


def resume_line(result: subprocess.CompletedProcess) -> str:
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("[resume] ")]
    return line


@dataclass
class Chain:
    out: Path
    interrupted: Path  # run A: stopped by SIGTERM, then resumed with no data options
    stopped_at: int
    resumed: subprocess.CompletedProcess
    full: Path  # A's run, uninterrupted, in another output_dir
    finished: Path  # run B: 2 steps, finished before A was resumed
    finished_kept: list[bool]  # B as it was, after `--resume latest` and after the refusal
    latest_of_finished: subprocess.CompletedProcess
    refused: subprocess.CompletedProcess
    extended: subprocess.CompletedProcess


def as_launched(*overrides: str, out: Path, clips: dict) -> Path:
    """A run of the test preset in this process, with the config the launch script gives
    training (the preset's path relative to the repository, where it runs): for the runs the
    chain only needs (what they make, not their processes). Returns the run directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO_ROOT)
        return train_here(out, clips, *overrides, config=os.path.relpath(TEST_CONFIG, REPO_ROOT))


@pytest.fixture(scope="module")
def chain(tmp_path_factory, demo_clips) -> Chain:
    """A (6 steps, stopped by SIGTERM), then B (2 steps, finished), then `--resume latest`
    with nothing else (continues A), B resumed by path as it is (refused) and with more
    steps and another learning rate (extended), `--resume latest` once both are finished
    (refused), and A uninterrupted elsewhere. A checkpoints at its end only: its one
    checkpoint before the end is the one its SIGTERM saves. Every run is at the smallest
    step (TINY); B and the uninterrupted A only serve the others, so they run in this
    process."""
    root = tmp_path_factory.mktemp("own_videos")
    out, data = root / "out", data_options(demo_clips)
    six_steps = ("--max_train_steps=6", "--checkpointing_steps=6", *TINY)
    succeeded(launch("1", "test", *data, f"--output_dir={out}", *six_steps, "--fault_injection=sigterm@3"))
    (interrupted,) = out.iterdir()
    stopped_at = max(int(p.name.split("-")[1]) for p in (interrupted / "checkpoints").iterdir())
    as_launched("--max_train_steps=2", *TINY, out=out, clips=demo_clips)
    (finished,) = set(out.iterdir()) - {interrupted}
    finished_before = snapshot(finished)
    resumed = succeeded(launch("1", "test", f"--output_dir={out}", "--resume", "latest"))
    finished_kept = [snapshot(finished) == finished_before]
    checkpoint = finished / "checkpoints" / "checkpoint-2"
    refused = launch("1", "test", "--resume", str(checkpoint))
    finished_kept.append(snapshot(finished) == finished_before and len(list(out.iterdir())) == 2)
    extended = succeeded(
        launch("1", "test", "--resume", str(checkpoint), "--max_train_steps=4", "--learning_rate=5e-4")
    )
    latest_of_finished = launch("1", "test", f"--output_dir={out}", "--resume", "latest")
    full = as_launched(*six_steps, out=root / "full", clips=demo_clips)
    return Chain(
        out,
        interrupted,
        stopped_at,
        resumed,
        full,
        finished,
        finished_kept,
        latest_of_finished,
        refused,
        extended,
    )


def test_a_resume_continues_with_the_runs_own_config_bit_identically(chain):
    """`--resume latest` alone: the run's data and its 6 steps, not the preset's
    (demo_output/data, 4 steps); one visible line names the checkpoint, its step of 6, the
    run and the changes (none); the weights equal an uninterrupted run's."""
    run, step = chain.interrupted, chain.stopped_at
    assert 0 < step < 6
    checkpoint = run / "checkpoints" / f"checkpoint-{step}"
    assert resume_line(chain.resumed) == (
        f"[resume] from {checkpoint} at step {step} of 6 (run {run}); changed on resume: nothing"
    )
    assert f"resumed from {checkpoint} at step {step} of 6" in (run / "train.log").read_text()
    assert (run / "checkpoints" / "checkpoint-6").is_dir()
    assert_identical(chain.full / "final_model.safetensors", run / "final_model.safetensors")
    per_start = {"output_dir", "resume_from_checkpoint"}
    saved, uninterrupted = (json.loads((r / "config.json").read_text()) for r in (run, chain.full))
    assert {k: v for k, v in saved.items() if k not in per_start} == {
        k: v for k, v in uninterrupted.items() if k not in per_start
    }
    assert json.loads((run / "finished.json").read_text()) == {"step": 6, "reason": "finished", "max_train_steps": 6}


def test_resume_latest_passes_over_a_finished_run_and_leaves_it_as_it_was(chain):
    """The newest run is finished: `--resume latest` continues the older unfinished one and
    leaves the finished one as it was; once every run is finished it is refused, naming the
    way to extend one."""
    assert f"(run {chain.interrupted})" in resume_line(chain.resumed)
    assert chain.finished_kept == [True, True]
    line = only_error_line(chain.latest_of_finished)
    assert line.startswith(f"error: --resume latest: every test run under {chain.out} is finished (newest: ")
    assert "--max_train_steps=<more than" in line


def test_a_finished_run_is_resumed_only_by_path_and_only_to_extend_it(chain):
    """As it is, it is refused before anything is written; with a higher max_train_steps
    it goes on, says that it extends the finished run and lists the changes."""
    run = chain.finished
    assert only_error_line(chain.refused) == (
        f"error: {run} finished at step 2 (max_train_steps=2): give --max_train_steps above 2 to extend it, "
        "or start a new run (without --resume)"
    )
    assert resume_line(chain.extended) == (
        f"[resume] from {run / 'checkpoints' / 'checkpoint-2'} at step 2 of 4 (the finished run {run}, extending "
        "it); changed on resume: max_train_steps 2 -> 4, learning_rate 0.001 -> 0.0005; final_model.* and "
        "export/ are replaced at its end"
    )
    assert "changed on resume: max_train_steps 2 -> 4, learning_rate 0.001 -> 0.0005" in (run / "train.log").read_text()
    assert json.loads((run / "finished.json").read_text())["step"] == 4
    assert json.loads((run / "config.json").read_text())["learning_rate"] == 5e-4


def printed(log: str, label: str) -> list[str]:
    """The command a run's log gives after ``label`` (its last occurrence), as words."""
    (line,) = [line for line in log.splitlines() if f"{label}: " in line][-1:]
    return shlex.split(line.split(f"{label}: ", 1)[1])


def test_the_readme_sequence_runs_each_command_the_previous_step_printed_from_another_folder(tmp_path, demo_clips):
    """README, "Train on your own videos", at the smallest size, typed in a folder of the
    user's own: --data=DIR (relative to that folder) annotates the folder and trains with a
    validation set; a SIGTERM (the test's stand-in for Ctrl+C) saves and prints the command
    that resumes; that command finishes the run, whose log prints the commands that evaluate
    and export it; both work from that folder too."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "videos").symlink_to(demo_clips["root"])
    out = tmp_path / "out"
    steps = ("--max_train_steps=2", "--fault_injection=sigterm@1")  # the resume makes step 2 and validates
    readme = re.search(
        r"^/path/to/taehv-train/train_taehv_h100.sh (.*?)\s+#", (REPO_ROOT / "README.md").read_text(), re.M
    )
    typed = shlex.split(readme.group(1))
    assert typed == ["1", "scratch", "--data=videos"]
    first = succeeded(launch(*typed, f"--output_dir={out}", *TINY_SCRATCH, *steps, cwd=home))
    assert "[ok] data: " in first.stdout and "--val_annotation_file=" in first.stdout
    assert "train on them" not in first.stdout  # the launch goes on to train on them with its own preset
    (run,) = [p for p in out.iterdir() if p.name != "annotations"]
    config = json.loads((run / "config.json").read_text())
    assert config["val_annotation_file"].endswith("annotations_val.json")
    resume = [word for word in printed((run / "train.log").read_text(), "Resume with") if "fault_injection" not in word]
    assert resume[:4] == [str(SCRIPT), "1", "scratch", f"--data={home / 'videos'}"]
    succeeded(subprocess.run(["bash", *resume], capture_output=True, text=True, cwd=home, timeout=300))
    log = (run / "train.log").read_text()
    assert (run / "finished.json").is_file() and "val/psnr" in log
    assert [p for p in (run / "logs").iterdir() if p.is_dir()] == []  # the start and the resume: one TensorBoard run
    for label in ("evaluate it", "export it"):
        command = printed(log, label)
        assert all(Path(word).is_absolute() for word in command if "/" in word), command
        succeeded(subprocess.run(command, capture_output=True, text=True, cwd=home, timeout=300))
    assert json.loads((run / "eval" / "metrics.json").read_text())["samples"]
    assert (out / f"{run.name}_tae" / "taecvx_own_latents.pth").is_file()


def test_the_readme_shard_commands_pack_a_folder_and_train_on_the_shards_from_another_folder(tmp_path, demo_clips):
    """README, "Millions of clips, or clips in a bucket", typed in a folder of the user's own
    at the smallest size: a folder of six cameras' clips packed into shards (train and val), then the launch
    script trains on the shards as they are, with validation from the val shards."""
    home, out = tmp_path / "home", tmp_path / "out"
    (home / "videos").mkdir(parents=True)
    for i, clip in enumerate(sorted(Path(demo_clips["root"]).rglob("*.mp4"))):  # six cameras: sources to split
        (home / "videos" / f"cam{i}_{clip.name}").symlink_to(clip)
    readme = (REPO_ROOT / "README.md").read_text()
    block = re.search(
        r"```bash\n(python -m taehv_train\.training\.make_annotations videos --to_shards.*?)```", readme, re.S
    )
    pack_line, train_line = block.group(1).strip().splitlines()
    pack = shlex.split(pack_line)
    succeeded(subprocess.run([sys.executable, *pack[1:]], capture_output=True, text=True, cwd=home, timeout=300))
    assert sorted(p.name for p in (home / "shards" / "val").iterdir())  # clips held out
    script, *typed = shlex.split(train_line.split("#")[0])
    assert script == "/path/to/taehv-train/train_taehv_h100.sh" and typed == ["1", "scratch", "--data=shards"]
    succeeded(launch(*typed, f"--output_dir={out}", *TINY_SCRATCH, cwd=home))
    (run,) = out.iterdir()
    config = json.loads((run / "config.json").read_text())
    shards = home / "shards"
    assert (config["data_root"], config["annotation_file"], config["val_annotation_file"]) == (
        f"{shards}/train/*.tar",
        "",
        f"{shards}/val/*.tar",
    )
    assert (run / "finished.json").is_file() and "val/psnr" in (run / "train.log").read_text()
