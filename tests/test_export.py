"""`python -m taehv_train.training.export` and `inference.py` refuse what would lose or hide something:
--out naming a file, a folder that already holds the bundle's files (unless --force), a
read-only folder, weights damaged in the middle (NaN/Inf); each is one line and exit status
2, and the user's files are left as they were."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO_ROOT
from taehv_train.models.taehv import TAEHV
from taehv_train.models.weights import save_weights

pytestmark = pytest.mark.slow  # processes of the tool


def damage_the_middle(path, size: int = 4 << 20) -> None:
    """``size`` random bytes written over the middle of a file (its size unchanged)."""
    data = bytearray(path.read_bytes())
    start = (len(data) - size) // 2
    data[start : start + size] = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))


UNSHARE = subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


def export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "taehv_train.training.export", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )


def assert_one_line(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr, result.stderr


def test_a_missing_source_is_blamed_on_the_source(tmp_path):
    result = export(tmp_path / "nowhere", "--out", tmp_path / "bundle")
    missing = f"weight file {tmp_path / 'nowhere'} not found; where to get weights: checkpoints/README.md"
    assert_one_line(result, missing)
    assert "cannot write" not in result.stderr and not (tmp_path / "bundle").exists()


def test_export_refuses_to_overwrite_or_to_write_into_a_file(tmp_path):
    torch.manual_seed(0)
    weights = save_weights(TAEHV(variant="taecvx"), tmp_path / "w.safetensors")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert_one_line(export(weights, "--out", a_file), f"--out {a_file} is a file: name a folder for the bundle")
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "README.md").write_text("my own readme")
    assert_one_line(export(weights, "--out", out), f"{out} already holds README.md: pass --force to replace them")
    assert (out / "README.md").read_text() == "my own readme" and sorted(p.name for p in out.iterdir()) == ["README.md"]
    assert export(weights, "--out", out, "--force").returncode == 0
    assert "# taecvx (TAE)" in (out / "README.md").read_text()


@pytest.mark.skipif(not UNSHARE, reason="needs unshare -rm (a private mount namespace) for a read-only tmpfs")
def test_export_into_a_read_only_folder_is_one_line(tmp_path):
    torch.manual_seed(0)
    weights = save_weights(TAEHV(variant="taecvx"), tmp_path / "w.safetensors")
    folder = tmp_path / "ro"
    folder.mkdir()
    script = (
        f"mount -t tmpfs -o ro,size=1m none {folder} && {sys.executable} -m taehv_train.training.export {weights} "
        f"--out {folder}/bundle"
    )
    result = subprocess.run(
        ["unshare", "-rm", "bash", "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120
    )
    assert_one_line(result, f"cannot write the bundle into {folder}/bundle: Read-only file system")


def beyond_fp16(variant: str, path) -> object:
    """Weights of ``variant`` holding 1e6 and -7e4 (just beyond fp16's 65504 the other way)."""
    torch.manual_seed(0)
    model = TAEHV(variant=variant)
    with torch.no_grad():
        model.encoder[0].weight.view(-1)[0] = 1e6
        model.decoder[-1].weight.view(-1)[0] = -7e4
    return save_weights(model, path)


def test_fp16_export_of_weights_beyond_fp16_is_refused_without_writing(tmp_path):
    """Such values would become inf in an fp16 file: --fp16 is refused in one line giving
    the count of tensors and the largest value, and nothing is written. A 16-channel TAE on
    scaled latents, whose ComfyUI file is fp16 by ComfyUI's rule, is refused without --fp16
    too, and the line says why."""
    weights = beyond_fp16("taecvx", tmp_path / "w.safetensors")
    assert_one_line(
        export(weights, "--out", tmp_path / "bundle", "--fp16"),
        "2 tensor(s) do not fit fp16 (e.g. encoder.0.weight; largest magnitude 1e+06, fp16 holds up to 65504): "
        "export without --fp16",
    )
    assert not (tmp_path / "bundle").exists()
    assert_one_line(
        export(beyond_fp16("taehv", tmp_path / "taehv.safetensors"), "--out", tmp_path / "taehv_bundle"),
        "fp16 holds up to 65504): ComfyUI takes taehv.safetensors as this TAE only in fp16, so these weights "
        "cannot be exported",
    )
    assert not (tmp_path / "taehv_bundle").exists()


def test_weights_damaged_in_the_middle_are_refused_by_export_and_inference(tmp_path, videos_dir):
    torch.manual_seed(0)
    weights = save_weights(TAEHV(variant="taecvx"), tmp_path / "taecvx.safetensors")
    damage_the_middle(weights)
    assert_one_line(export(weights, "--out", tmp_path / "bundle"), "hold NaN or Inf")
    assert not (tmp_path / "bundle").exists()
    clip = sorted(videos_dir.glob("*.mp4"))[0]
    result = subprocess.run(
        [
            sys.executable,
            "inference.py",
            "--model_path",
            str(weights),
            "--videos",
            str(clip),
            "--n_frames",
            "5",
            "--height",
            "32",
            "--width",
            "48",
            "--num_samples",
            "1",
            "--output_dir",
            str(tmp_path / "eval"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert_one_line(result, "hold NaN or Inf")
    assert not (tmp_path / "eval" / "metrics.json").exists()
