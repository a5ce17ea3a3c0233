"""bench/bench_gpu.py and bench/gpu_check.py --tiny run end to end on the CPU.

bench_gpu's model rows: a row per (variant, implementation, operation, setting) with finite
timings and our outputs equal to the published model's (fp32), compiled with Dynamo's eager
backend (the compiled code paths run without the minutes inductor takes on a CPU). Its
end-to-end rows are the ones gpu_check runs (bench/lib/gpu_training.py), checked once, through
gpu_check: the launch script's runs and the on-device engine (DeepSpeed ZeRO-2 on gloo),
plain and with a real latent cache, and every pending figure in the JSON and the Markdown
table. A missing or empty clips folder is one line and exit status 2, before anything runs.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.lib.harness import published_file
from conftest import REPO_ROOT, _require

pytestmark = pytest.mark.slow  # benchmarks

VARIANTS = {"taehv1_5": (2, 32)}  # patch size, latent channels (the default's taew2_1 runs the same code)
FIGURES = {"e2e_plain", "e2e_cached", "plain_step", "train_speed", "mfu_logged", "gpu_idle_logged", "zero2_vs_ddp"}
STATUSES = {"pass", "below target", "measured", "logged", "missing", "skipped", "error", "not run"}


def test_gpu_benchmark_tiny_compares_ours_with_the_published_model():
    published = _require(published_file(), "the published taehv.py")
    args = [
        sys.executable,
        "-m",
        "bench.bench_gpu",
        "--tiny",
        "--no-e2e",
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
    assert report["end_to_end"] == [] and report["end_to_end_setup"] is None

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


@pytest.mark.parametrize("module", ["bench.bench_gpu", "bench.gpu_check"])
@pytest.mark.parametrize("folder", ["missing", "empty"])
def test_a_missing_or_empty_videos_dir_is_one_line_before_anything_runs(module, folder, tmp_path, monkeypatch, capsys):
    """In this process (no interpreter start-up to pay): the error line and exit status 2,
    and nothing measured."""
    import importlib

    bench = importlib.import_module(module)
    videos = tmp_path / "clips"
    if folder == "empty":
        videos.mkdir()
        (videos / "notes.txt").write_text("no video here")

    def measured(*args, **kwargs):
        raise AssertionError("it measured before refusing the clips folder")

    monkeypatch.setattr(bench, "run" if module == "bench.bench_gpu" else "prepare_clips", measured)
    monkeypatch.setattr(bench, "render_clips", measured, raising=False)
    monkeypatch.setattr(sys, "argv", [module, "--tiny", "--videos_dir", str(videos)])
    capsys.readouterr()  # what importing it printed
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --videos_dir ") and str(videos) in err, err
    assert ("no such folder" if folder == "missing" else "no video files") in err


@pytest.fixture(scope="module")
def gpu_check(tmp_path_factory, videos_dir) -> tuple[dict, str, str]:
    """``python -m bench.gpu_check --tiny`` once: its JSON, its Markdown file and its stdout."""
    published = _require(published_file(), "the published taehv.py")
    out = tmp_path_factory.mktemp("gpu_check") / "check.json"
    args = [
        sys.executable,
        "-m",
        "bench.gpu_check",
        "--tiny",
        "--videos_dir",
        str(videos_dir),
        "--published",
        str(published),
        "--out",
        str(out),
    ]
    result = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(out.read_text()), out.with_suffix(".md").read_text(), result.stdout


def test_gpu_check_tiny_takes_every_pending_figure_with_device_and_date(gpu_check):
    report, markdown, stdout = gpu_check
    assert report["device"].startswith("cpu") and report["date"] and report["tiny"]
    assert report["versions"]["torch"] and report["versions"]["deepspeed"]
    figures = {fig["id"]: fig for fig in report["figures"]}
    assert set(figures) == FIGURES and len(report["figures"]) == len(FIGURES)
    for fig in figures.values():
        assert fig["status"] in STATUSES and fig["figure"] and fig["target"], fig
        if fig["status"] in ("skipped", "not run", "error", "missing"):
            assert fig["reason"], fig
    for name in ("e2e_plain", "e2e_cached", "plain_step", "train_speed"):  # --tiny: measured, no target check
        assert figures[name]["status"] == "measured" and figures[name]["value"] > 0, figures[name]
    assert figures["e2e_plain"]["value"] == report["end_to_end"][1]["ratio_to_on_device"]
    assert "2+ GPUs" in figures["zero2_vs_ddp"]["reason"] and figures["zero2_vs_ddp"]["status"] == "skipped"
    for name in ("mfu_logged", "gpu_idle_logged"):  # logged on a GPU only
        assert figures[name]["status"] == "skipped", figures[name]
    speed = report["train_speed"]
    assert speed["case"] == "1x5x16x16" and speed["command"].startswith("python -m bench.bench_train_speed")
    assert speed["ratio"] == figures["train_speed"]["value"] and speed["loss_diff"] < 1e-4, speed

    assert markdown == report["markdown"] and markdown in stdout
    assert report["device"] in markdown.splitlines()[0] and report["date"] in markdown.splitlines()[0]
    table = [line for line in markdown.splitlines() if line.startswith("| ")]
    assert table[0] == "| figure | target | measured | status |"
    for fig in figures.values():
        assert any(line.startswith(f"| {fig['figure']} |") for line in table), fig["figure"]


def test_gpu_check_tiny_runs_the_launch_script_against_the_same_engine_on_the_device(gpu_check):
    """Every (feed, row) ran what it says: the launch script users type, and the on-device
    step in the engine DeepSpeed ZeRO-2 builds, with rates that agree with what they counted."""
    report, _, _ = gpu_check
    rows = report["end_to_end"]
    assert [(row["feed"], row["setting"]) for row in rows] == list(
        itertools.product(["plain", "cached"], ["on_device", "launch_script"])
    )
    clips = report["settings"]["clips"]
    assert clips["size"] == "96x64" and len(clips["videos"]) == 2 and clips["entries_per_epoch"] == 32
    for row in rows:
        assert "error" not in row, row
        assert row["clips_per_s"] > 0 and 0 <= row["data_wait"] < 1 and row["tflops"] > 0, row
        assert abs(row["frames_per_s"] - 9 * row["clips_per_s"]) < 0.01 * row["frames_per_s"], row  # 9 frames
        assert row["mfu"] is None and row["gpu_idle"] is None, row  # no GPU peak, no GPU
        assert math.isfinite(row["last_loss"]), row
        assert (row["reference_vae"] or "").startswith("tiny CogVideoX") == (row["feed"] == "cached"), row
        command = row["command"]
        assert ("--latent_cache_dir=" in command) == (row["feed"] == "cached"), command
        assert ("--ref_vae_path= " in command) == (row["feed"] == "plain"), command
        if row["setting"] == "on_device":
            assert " -m taehv_train.training.launch --use_deepspeed --zero_stage 2 " in command, command
            assert " -m bench.lib.on_device_step --config training/configs/taehv_config_1gpu_h100.py " in command
            engine = row["engine"]
            assert (engine["distributed_type"], engine["zero_stage"], engine["processes"]) == ("DEEPSPEED", 2, 1)
            assert engine["optimizer"] == "DeepSpeedZeroOptimizer" and not engine["cudnn_benchmark"], engine
            assert row["steps"] >= 1 and row["micro_batches"] == 2 * row["steps"] and row["seconds"] >= 1, row
            assert row["data_wait"] < 0.05 and not row["compiled"], row  # batches on the device; auto: eager on a CPU
            clips_per_s = row["micro_batches"] * 2 / row["seconds"]
            assert abs(row["clips_per_s"] - clips_per_s) < 0.01 * clips_per_s, row
        else:
            assert command.startswith("./train_taehv_h100.sh 1 1gpu_h100 --data_root="), command
            assert "--max_train_steps=3" in command and "--log_every=1" in command, command
            assert row["exit_status"] == 0 and row["log_steps"] == [2, 3] and row["steps"] == 2, row
            assert "train/samples_per_second" in row["tags"] and "train/data_wait" in row["tags"], row
            assert row["log_line"] and "clips/s" in row["log_line"] and not row["compiled"], row
            on_device = rows[rows.index(row) - 1]
            assert abs(row["ratio_to_on_device"] - row["clips_per_s"] / on_device["clips_per_s"]) < 0.01, row
    # the cached step's forward also decodes the reference latents: more FLOPs per clip
    flops_per_clip = {row["feed"]: row["tflops"] / row["clips_per_s"] for row in rows if row["setting"] == "on_device"}
    assert flops_per_clip["cached"] > flops_per_clip["plain"]


def test_run_figures_leave_out_the_first_steps_and_weight_each_interval_by_its_seconds():
    from bench.lib.gpu_training import run_figures

    scalars = {  # logged every 10 steps of 4 clips: 100 s for the first (compilation), then 4 s and 8 s
        "train/samples_per_second": [(10, 0.4), (20, 10.0), (30, 5.0)],
        "train/data_wait": [(10, 0.9), (20, 0.1), (30, 0.4)],
        "train/gpu_memory_gb": [(10, 3.0), (20, 3.5), (30, 3.5)],
        "train/loss": [(10, 1.0), (20, 0.5), (30, 0.25)],
    }
    figures = run_figures(scalars, {"train_batch_size": 2, "gradient_accumulation_steps": 2, "n_frames": 17}, 10)
    assert figures["log_steps"] == [20, 30] and figures["steps"] == 20 and figures["seconds"] == 12
    assert figures["clips_per_s"] == round(80 / 12, 3) and figures["frames_per_s"] == round(17 * 80 / 12, 2)
    assert figures["data_wait"] == round((0.1 * 4 + 0.4 * 8) / 12, 4)
    assert figures["gpu_idle"] is None and figures["mfu"] is None  # not logged (a CPU)
    assert figures["gpu_memory_gb"] == 3.5 and figures["last_loss"] == 0.25
    with pytest.raises(ValueError, match="too short"):
        run_figures(scalars, {"train_batch_size": 2, "gradient_accumulation_steps": 2, "n_frames": 17}, 30)


def test_the_budget_keeps_the_later_parts_minimum_and_leaves_out_what_no_longer_fits():
    from bench.gpu_check import Budget, NotRun

    now = [0.0]
    budget = Budget(100, {"a": (50, 10), "b": (50, 30), "c": (50, 20)}, clock=lambda: now[0])
    assert budget.bound("a") == 50  # 100 s left, 50 of them kept for b and c
    now[0] = 40
    assert budget.bound("b") == 40  # 60 s left, 20 kept for c
    now[0] = 85
    with pytest.raises(NotRun, match="not run: 15 s of the 100 s budget were left"):
        budget.bound("c")  # under its 20 s minimum


def test_gpu_check_judges_gpu_rows_against_the_targets():
    """What a GPU run's rows make of the figures (no GPU here: the rows are made up)."""
    from bench import gpu_check

    line = "loss 0.05, 40.00 clips/s, data wait 1%, GPU idle 3%, 12 TFLOP/s, MFU 1.2%"
    rows = [
        {"feed": "plain", "setting": "on_device", "clips_per_s": 42.0},
        {"feed": "plain", "setting": "launch_script", "clips_per_s": 40.0, "ratio_to_on_device": 0.952, "mfu": 0.012,
         "gpu_idle": 0.03, "tags": ["train/mfu", "train/gpu_idle"], "log_line": line,
         "log_line_has_mfu": True, "log_line_has_gpu_idle": True},
        {"feed": "cached", "setting": "on_device", "clips_per_s": 50.0},
        {"feed": "cached", "setting": "launch_script", "error": "not run: 20 s of the 480 s budget were left"},
    ]  # fmt: skip
    assert gpu_check.e2e_figure("plain", rows, tiny=False).status == "pass"
    cached = gpu_check.e2e_figure("cached", rows, tiny=False)
    assert cached.status == "not run" and cached.reason.startswith("not run: 20 s")
    assert gpu_check.plain_step_figure(rows, tiny=False).status == "pass"  # 40 >= 36.4
    rows[1]["clips_per_s"] = 30.0
    assert gpu_check.plain_step_figure(rows, tiny=False).status == "below target"
    mfu = gpu_check.logged_figure("train/mfu", "MFU", rows, "cuda")
    assert mfu.status == "logged" and mfu.value == 0.012 and "TensorBoard yes, log line yes" in mfu.shown
    rows[1]["log_line_has_gpu_idle"] = False
    assert gpu_check.logged_figure("train/gpu_idle", "GPU idle", rows, "cuda").status == "missing"
    speed = gpu_check.train_speed_figure({"ratio": 0.97, "ours_s": 0.086, "published_s": 0.083}, tiny=False)
    assert speed.status == "below target" and speed.value == 0.97
    assert gpu_check.scaling_figure(None, gpus=1).status == "skipped"
    runs = {"runs": [{"strategy": "ddp", "samples_per_s": 20.0}, {"strategy": "zero2", "samples_per_s": 19.0}]}
    assert gpu_check.scaling_figure(runs, gpus=2).status == "measured"


def test_a_row_past_its_time_bound_is_killed_with_every_process_it_started(tmp_path):
    from bench.lib.gpu_training import child_env, run_bounded

    pids = tmp_path / "pids"
    # a child in its own session, as torch elastic starts training ranks: a signal to the group would miss it
    script = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(120)\n"
    )
    finished = run_bounded([sys.executable, "-c", script], 3, tmp_path / "log", child_env())
    assert finished.status is None and 3 <= finished.seconds < 60, finished
    assert pids.is_file(), f"the script had not started its child within 3 s: {finished}"

    def gone(pid: int) -> bool:  # or a zombie not yet reaped by its new parent
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    for pid in map(int, pids.read_text().split()):
        deadline = time.monotonic() + 10
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(pid), f"process {pid} outlived the time bound"
