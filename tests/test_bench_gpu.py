"""bench/bench_gpu.py --tiny runs end to end on the CPU: a row per (variant, implementation,
operation, setting) with finite timings, our outputs equal to the published model's (fp32),
the training step eager and compiled, and the end-to-end rows (the step fed by the real
loader and from the device, plain and with a real latent cache). Compiled with Dynamo's
eager backend: the compiled code paths run (graphs are traced) without the minutes
inductor takes on a CPU."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import pytest

from bench.harness import published_file
from conftest import REPO_ROOT, _require

pytestmark = pytest.mark.slow  # a benchmark

VARIANTS = {"taehv1_5": (2, 32)}  # patch size, latent channels (the default's taew2_1 runs the same code)


def test_gpu_benchmark_tiny_compares_ours_with_the_published_model():
    published = _require(published_file(), "the published taehv.py")
    args = [
        sys.executable,
        "-m",
        "bench.bench_gpu",
        "--tiny",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--compile",
        "--compile-backend",
        "eager",
        "--published",
        str(published),
        "--variants",
        *VARIANTS,
    ]
    result = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    settings = report["settings"]
    assert report["device"].startswith("cpu") and report["torch"] and report["date"]
    assert (settings["frames"], settings["height"], settings["width"], settings["dtypes"]) == (9, 32, 32, ["fp32"])
    assert settings["variants"] == list(VARIANTS) and settings["tiny"] and settings["compile"]

    rows = {(r["variant"], r["implementation"], r["op"], r["setting"]): r for r in report["model"]}
    expected = set(
        itertools.product(VARIANTS, ["ours", "published"], ["encode", "decode", "stream_decode"], ["eager", "compiled"])
    )
    assert set(rows) == expected and len(report["model"]) == len(expected)
    for (variant, implementation, op, setting), row in rows.items():
        assert "error" not in row, row
        assert row["dtype"] == "fp32"
        assert 0 < row["seconds"] < 60 and math.isfinite(row["frames_per_s"]) and row["frames_per_s"] > 0, row
        assert math.isfinite(row["peak_mb"]) and row["peak_mb"] >= 0, row
        patch, channels = VARIANTS[variant]
        shape = [1, 3, channels, 32 // (8 * patch), 32 // (8 * patch)] if op == "encode" else [1, 9, 3, 32, 32]
        assert row["output_shape"] == shape, row
        assert (row["graphs_compiled_first_call"] > 0) == (setting == "compiled"), row  # compiled rows really compiled
        if implementation == "ours":
            assert row["max_abs_diff_vs_published"] < 1e-4, row
            assert math.isfinite(row["speedup_vs_published"]) and row["speedup_vs_published"] > 0, row
            published = rows[(variant, "published", op, setting)]
            ratio = published["seconds"] / row["seconds"]
            assert abs(row["speedup_vs_published"] - ratio) < 0.01 * ratio, (row, published)
        else:
            assert "speedup_vs_published" not in row and "max_abs_diff_vs_published" not in row
    assert (
        "reduce-overhead" not in rows[("taehv1_5", "ours", "stream_decode", "compiled")]["compile"]
    )  # CPU: no CUDA graphs

    setup, train = report["train_step_setup"], report["train_step"]
    assert setup["preset"].endswith("taehv_config_1gpu_h100.py") and setup["variant"] == "taecvx"
    assert (setup["n_frames"], setup["height"], setup["width"], setup["mixed_precision"]) == (9, 8, 8, "no")
    assert [row["setting"] for row in train] == ["eager", "compiled"]
    for row in train:
        assert "error" not in row, row
        assert 0 < row["step_s"] < 60 and math.isfinite(row["last_loss"]) and row["peak_mb"] >= 0, row
        assert (
            abs(row["images_per_s"] - setup["batch"] * setup["n_frames"] / row["step_s"]) < 0.01 * row["images_per_s"]
        )
    assert train[1]["graphs_compiled_first_call"] > 0 and train[1]["first_loss_diff_vs_eager"] < 1e-4

    check_end_to_end(report["end_to_end_setup"], report["end_to_end"])


def check_end_to_end(setup: dict, rows: list[dict]) -> None:
    """Every (feed, setting) row measured the preset's windows on the tiny clips, with rates
    that agree with what it counted."""
    assert setup["preset"].endswith("taehv_config_1gpu_h100.py") and setup["variant"] == "taecvx"
    assert (setup["n_frames"], setup["height"], setup["width"], setup["batch"]) == (9, 8, 8, 2)
    assert setup["gradient_accumulation_steps"] == 8 and setup["workers"] == 1
    assert setup["compile"] == "auto" and not setup["compiled"]  # auto: eager on a CPU
    assert setup["clips"]["size"] == "96x64" and len(setup["clips"]["videos"]) == 2
    assert [(row["feed"], row["setting"]) for row in rows] == list(
        itertools.product(["plain", "cached"], ["on_device", "loader"])
    )
    for row in rows:
        assert "error" not in row, row
        assert row["steps"] >= 1 and row["micro_batches"] == 8 * row["steps"], row  # 16 micro-batches an epoch
        assert row["seconds"] >= setup["seconds_per_row"] and not row["compiled"], row
        clips_per_s = row["micro_batches"] * setup["batch"] / row["seconds"]
        assert abs(row["clips_per_s"] - clips_per_s) < 0.01 * clips_per_s, row
        assert abs(row["frames_per_s"] - 9 * row["clips_per_s"]) < 0.01 * row["frames_per_s"], row
        assert row["tflops"] > 0 and row["mfu"] is None and row["gpu_idle"] is None, row  # no GPU peak, no GPU
        assert 0 <= row["data_wait"] < 1 and math.isfinite(row["last_loss"]), row
        assert (row["reference_vae"] or "").startswith("tiny CogVideoX") == (row["feed"] == "cached"), row
        if row["setting"] == "loader":
            on_device = rows[rows.index(row) - 1]
            assert row["workers"] == 1, row
            assert abs(row["ratio_to_on_device"] - row["clips_per_s"] / on_device["clips_per_s"]) < 0.01, row
    # the cached step's forward also decodes the reference latents: more FLOPs per clip
    flops_per_clip = {row["feed"]: row["tflops"] / row["clips_per_s"] for row in rows}
    assert flops_per_clip["cached"] > flops_per_clip["plain"]
