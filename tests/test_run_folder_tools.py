"""The tools given a run folder (``inference.py``, ``python -m taehv_train.training.export``): the run's
config gives the data, sizes and variant; they take its best validation, or with
``--weights final`` its final weights (an unfinished run's newest checkpoint), and say
which; a plain autoencoder is named and described as having a latent space of its own.
They read a run that is still training: the checkpoint they chose stays while they read it,
its rotation notwithstanding. One finished plain-autoencoder run (the test preset) serves
every test; its copy without ``final_model.*`` and its last checkpoint is the unfinished run."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from test_export import export
from test_inference import run_inference  # noqa: F401 (a fixture)
from test_train import scalars

from conftest import REPO_ROOT
from taehv_train.models.diffusers_vae import TAEVideoVAE
from taehv_train.models.latent_spaces import OWN
from taehv_train.models.taehv import TAEHV
from taehv_train.training import export as export_tool
from train_runs import assert_identical, train_here, wait_for

pytestmark = pytest.mark.slow  # a training run and the tools' processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_clips) -> dict[str, Path]:
    """A finished 4-step run (checkpoints at 2 and 4) and an unfinished copy stopped at step 2."""
    finished = train_here(tmp_path_factory.mktemp("runs"), demo_clips)
    unfinished = tmp_path_factory.mktemp("unfinished") / finished.name
    shutil.copytree(finished, unfinished)
    leftovers = ("final_model.pth", "final_model.safetensors", "export", "finished.json", "checkpoints/checkpoint-4")
    for leftover in leftovers:
        path = unfinished / leftover
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return {"finished": finished, "unfinished": unfinished}


def test_an_unfinished_run_gives_its_best_validation_or_its_newest_checkpoint(runs, run_inference, tmp_path):  # noqa: F811
    run = runs["unfinished"]
    step = json.loads((run / "best_model" / "model_info.json").read_text())["step"]
    best = f"{run.name}: its best validation, best_model/ at step {step} (val/psnr "
    result = run_inference("--model_path", str(run), "--output_dir", str(tmp_path / "best"), "--num_samples", "1")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert best in result.stdout and "the run has not finished" in result.stdout, result.stdout
    model = json.loads((tmp_path / "best" / "metrics.json").read_text())["model"]
    assert model["path"].endswith("best_model/weights.safetensors") and model["step"] == step

    note = f"{run.name} is unfinished: using checkpoints/checkpoint-2 (step 2 of 4)"
    result = run_inference(
        "--model_path", str(run), "--weights", "final", "--output_dir", str(tmp_path / "eval"), "--num_samples", "1"
    )
    assert result.returncode == 0 and note in result.stdout, result.stdout + result.stderr[-2000:]
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["model"]["path"].endswith("checkpoint-2/weights.safetensors")

    exported = export(run, "--out", tmp_path / "bundle", "--weights", "final")
    assert exported.returncode == 0 and note in exported.stdout, exported.stderr[-2000:]
    card = (tmp_path / "bundle" / "README.md").read_text()
    assert "2 of 4 steps" in card and f"- Weights: {note}" in card and "| **2** (exported) |" in card

    # a plain autoencoder: named, described and loaded as having its own latent space
    names = sorted(p.name for p in (tmp_path / "bundle").iterdir())
    assert names == ["README.md", "taecvx_own_latents.pth", "taecvx_own_latents.safetensors"]
    assert "latent space of its own" in card and "latent space of CogVideoX" not in card
    own_pth = TAEHV(tmp_path / "bundle" / "taecvx_own_latents.pth")  # no metadata: the name says it
    assert (own_pth.variant, own_pth.latent_space) == ("taecvx", OWN)
    with pytest.raises(ValueError, match="latent_space="):
        TAEVideoVAE.from_file(tmp_path / "bundle" / "taecvx_own_latents.pth")


def test_a_finished_run_gives_its_best_validation_unless_its_final_weights_are_asked_for(
    runs,
    run_inference,  # noqa: F811
    tmp_path,
    demo_clips,
):
    """Evaluation, export and the run's own bundle take the best validation and say which
    step it is; the model card lists every validation, the exported one marked, says how to
    load the bundle and names no local path."""
    run = runs["finished"]
    info = json.loads((run / "best_model" / "model_info.json").read_text())
    history = json.loads((run / "validation_history.json").read_text())
    assert [entry["step"] for entry in history] == [2, 4] and info["step"] in (2, 4)
    best = (
        f"{run.name}: its best validation, best_model/ at step {info['step']} (val/psnr {info['value']:.4g}, the "
        "best of 2 validations)"
    )
    final = (
        f"{run.name}: its final weights, final_model.safetensors at step 4 (val/psnr {history[-1]['val/psnr']:.4g}); "
        "--weights best (the default) for its best validation"
    )
    told = f"{best}; --weights final for its latest weights"
    choices = (([], told, "best_model/weights.safetensors"), (["--weights", "final"], final, "final_model.safetensors"))
    for flags, line, path in choices:
        out = tmp_path / f"eval{len(flags)}"
        result = run_inference("--model_path", str(run), "--output_dir", str(out), "--num_samples", "1", *flags)
        assert result.returncode == 0, result.stdout + result.stderr[-2000:]
        assert f"✅ Weights: {line}\n" in result.stdout, result.stdout
        assert json.loads((out / "metrics.json").read_text())["model"]["path"] == str(run / path)

    exported = export(run, "--out", tmp_path / "bundle")
    assert exported.returncode == 0 and f"weights: {told}\n" in exported.stdout, exported.stderr[-2000:]
    files = "taecvx_own_latents.pth, taecvx_own_latents.safetensors, README.md"
    assert f"wrote the export bundle {run / 'export'} ({files}): {told}\n" in (run / "train.log").read_text()
    for bundle in (run / "export", tmp_path / "bundle"):  # the run's own, written at its end, and an export
        assert_identical(bundle / "taecvx_own_latents.safetensors", run / "best_model" / "weights.safetensors")
        card = (bundle / "README.md").read_text()
        assert f"- Weights: {best}." in card
        rows = [line for line in card.splitlines() if line.startswith("| ") and not line.startswith("| step")]
        marked = [f"**{h['step']}** (exported)" if h["step"] == info["step"] else str(h["step"]) for h in history]
        assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == marked, card
        assert 'TAEHV("taecvx_own_latents.safetensors")' in card and 'checkpoint_path="taecvx_own_latents.pth"' in card
        for local in (str(REPO_ROOT), str(run.parent), str(demo_clips["root"]), str(tmp_path)):
            assert local not in card, (local, card)


def test_a_run_without_validation_gives_its_final_weights_and_says_so(runs, tmp_path):
    run = tmp_path / runs["finished"].name
    shutil.copytree(runs["finished"], run, ignore=shutil.ignore_patterns("best_model", "validation_history.json"))
    exported = export(run, "--out", tmp_path / "bundle")
    line = (
        f"{run.name}: its final weights, final_model.safetensors at step 4 (not validated at that step); it did not "
        "validate, so there is no best model"
    )
    assert exported.returncode == 0 and f"weights: {line}\n" in exported.stdout, exported.stdout + exported.stderr
    card = (tmp_path / "bundle" / "README.md").read_text()
    assert "The run did not validate: the bundle holds its final weights." in card
    assert_identical(tmp_path / "bundle" / "taecvx_own_latents.safetensors", run / "final_model.safetensors")


def test_a_finished_run_gives_the_evaluation_its_data_size_and_variant(
    runs,
    run_inference,  # noqa: F811
    tmp_path,
    demo_clips,
):
    run = runs["finished"]
    final_pth = TAEHV(run / "final_model.pth")  # no metadata: its run's config.json says what it is
    assert (final_pth.variant, final_pth.latent_space) == ("taecvx", OWN)

    def evaluate(*args: str) -> dict:
        out = tmp_path / f"eval{len(list(tmp_path.iterdir()))}"
        result = run_inference("--model_path", str(run), "--output_dir", str(out), "--num_samples", "1", *args)
        assert result.returncode == 0, result.stdout + result.stderr[-2000:]
        metrics = json.loads((out / "metrics.json").read_text())
        sample = metrics["samples"][0]
        return {**metrics["settings"], "sample": (sample["height"], sample["width"]), "stdout": result.stdout}

    from_run = evaluate()  # no data flags: the run's validation clips at its validation size
    assert "Defaults (data, size, frames, stride) from the run's" in from_run["stdout"]
    assert (from_run["height"], from_run["width"], from_run["n_frames"]) == (32, 32, 9)
    assert "is unfinished" not in from_run["stdout"]
    clip = str(sorted(Path(demo_clips["root"]).rglob("*.mp4"))[0])
    at_run_size = evaluate("--videos", clip)
    assert (at_run_size["height"], at_run_size["width"]) == (32, 32)
    assert "32x32 (the config's validation size; --native_size for the clips' own)" in at_run_size["stdout"]
    native = evaluate("--videos", clip, "--native_size")
    assert native["sample"] == (48, 64) and "each clip at its own size" in native["stdout"]
    assert (evaluate("--config", str(run / "config.json"))["height"]) == 32


def test_a_file_that_is_no_config_is_one_line(runs, run_inference, tmp_path):  # noqa: F811
    for name in ("train.log", "final_model.safetensors"):
        result = run_inference(
            "--model_path",
            str(runs["finished"]),
            "--config",
            str(runs["finished"] / name),
            "--output_dir",
            str(tmp_path),
        )
        error = result.stderr.strip().splitlines()[-1]
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert error.startswith("error: ") and "cannot read it as a config" in error, error


def test_the_logs_are_in_words(runs):
    log = (runs["finished"] / "train.log").read_text()
    assert "ProbeReport(" not in log and "unusable {}" not in log and "probed, all usable" in log
    logged = scalars(runs["finished"])
    assert "train/host_memory_gb" in logged  # what it is on every device
    assert ("train/gpu_memory_gb" in logged) == torch.cuda.is_available()


def rotated_while_read(monkeypatch, run: Path) -> list[list[str]]:
    """As a tool verifies the run's newest checkpoint, checkpoint-3, the run saves
    checkpoint-4 and rotates to one checkpoint (training's own rotation, in a thread of its
    own, waited for); the checkpoints the rotation left, once per tool."""
    from taehv_train.common import run_files
    from taehv_train.training.state.checkpoints import rotate_checkpoints

    checkpoints, checksum, left = run / "checkpoints", run_files.file_checksum, []

    def checksum_while_the_run_rotates(path: Path, *args) -> str:
        if path.parent.name == "checkpoint-3" and not (checkpoints / "checkpoint-4").exists():
            shutil.copytree(checkpoints / "checkpoint-2", checkpoints / "checkpoint-4")
            rotation = threading.Thread(target=rotate_checkpoints, args=(checkpoints, 1))
            rotation.start()
            rotation.join(timeout=60)
            left.append(sorted(p.name for p in checkpoints.iterdir()))
        return checksum(path, *args)

    monkeypatch.setattr(run_files, "file_checksum", checksum_while_the_run_rotates)
    return left


def test_the_tools_keep_the_checkpoint_they_read_from_the_rotation_of_a_run_still_training(
    runs,
    run_inference,  # noqa: F811
    monkeypatch,
    capsys,
    tmp_path,
):
    from taehv_train.training.state.checkpoints import rotate_checkpoints

    run = tmp_path / runs["unfinished"].name
    shutil.copytree(runs["unfinished"], run)
    left = rotated_while_read(monkeypatch, run)
    note = f"{run.name} is unfinished: using checkpoints/checkpoint-3 (step 3 of 4)"
    for tool in ("inference", "export"):
        shutil.copytree(run / "checkpoints" / "checkpoint-2", run / "checkpoints" / "checkpoint-3")
        if tool == "inference":
            out = tmp_path / "eval"
            result = run_inference("--model_path", str(run), "--weights", "final", "--output_dir", str(out))
            assert result.returncode == 0 and note in result.stdout, result.stdout + result.stderr[-2000:]
            assert json.loads((out / "metrics.json").read_text())["model"]["step"] == 3
        else:
            capsys.readouterr()
            export_tool.main([str(run), "--weights", "final", "--out", str(tmp_path / "bundle")])
            assert note in capsys.readouterr().out and (tmp_path / "bundle" / "README.md").is_file()
        # the rotation passed over the checkpoint being read; the next one, after the tool, removes it
        assert left.pop() == ["checkpoint-3", "checkpoint-4"]
        rotate_checkpoints(run / "checkpoints", 1)
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint-4"]
        (run / "checkpoints" / "checkpoint-4").rename(run / "checkpoints" / "checkpoint-2")


def waits_for_a_lock(path: Path) -> bool:
    """Whether a process waits for an ``flock`` on ``path`` (``/proc/locks``: ``->`` lines)."""
    inode = f":{path.stat().st_ino} "
    return any("->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines())


def test_a_new_best_waits_for_the_tool_reading_best_model(runs, run_inference, monkeypatch, tmp_path):  # noqa: F811
    from taehv_train.common import run_files
    from taehv_train.training.state.atomic_folders import rename_into_place

    run = tmp_path / runs["unfinished"].name
    shutil.copytree(runs["unfinished"], run)
    best, checksum, writers = run / "best_model", run_files.file_checksum, []
    step = json.loads((best / "model_info.json").read_text())["step"]

    def checksum_while_a_new_best_is_saved(path: Path, *args) -> str:
        if path.parent == best and not writers:  # the run's next best: checkpoint-2's folder, say
            manifest = best / "checkpoint.json"
            shutil.copytree(run / "checkpoints" / "checkpoint-2", run / ".tmp-best_model")
            writers.append(threading.Thread(target=rename_into_place, args=(run / ".tmp-best_model", best)))
            writers[0].start()
            wait_for(lambda: not writers[0].is_alive() or waits_for_a_lock(manifest), 60, "the new best")
        return checksum(path, *args)

    monkeypatch.setattr(run_files, "file_checksum", checksum_while_a_new_best_is_saved)
    result = run_inference("--model_path", str(run), "--output_dir", str(tmp_path / "eval"), "--num_samples", "1")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert f"{run.name}: its best validation, best_model/ at step {step} (val/psnr " in result.stdout, result.stdout
    writers[0].join(timeout=60)  # once the tool has loaded the weights, the new best replaces them
    assert not (best / "model_info.json").exists() and (best / "optimizer.json").is_file()


def test_a_checkpoint_folder_without_its_manifest_is_passed_over_by_a_reading_tool(runs, tmp_path):
    from contextlib import ExitStack

    from taehv_train.common.run_files import FINAL, run_weights

    run = tmp_path / runs["unfinished"].name
    shutil.copytree(runs["unfinished"], run)
    (run / "checkpoints" / "checkpoint-9").mkdir()  # a leftover of another version, say
    with ExitStack() as held:
        assert run_weights(run, FINAL, held).path == run / "checkpoints" / "checkpoint-2" / "weights.safetensors"
