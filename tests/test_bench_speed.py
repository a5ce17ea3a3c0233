"""bench/bench_speed.py (ours against the published TAEHV on CPU) runs end to end at tiny
sizes: one row per op/mode/case with alternating timings, outputs equal to the
published ones, the roofline, the peak-memory processes, the Markdown and the exit code."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from bench.lib.harness import published_file
from conftest import REPO_ROOT

TINY = ["--variants", "taehv", "--frames", "5", "--sizes", "16x16"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not published_file().exists(),
        reason="the published implementation (shared/reference) is not here",
    ),
]


def _run(*args: str) -> tuple[dict, str]:
    result = subprocess.run(
        [sys.executable, "-m", "bench.bench_speed", *TINY, *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report, end = json.JSONDecoder().raw_decode(result.stdout)
    return report, result.stdout[end:]


def test_speed_rows_roofline_and_markdown(tmp_path):
    out = tmp_path / "speed.json"
    report, rest = _run(
        "--repeats",
        "2",
        "--warmup",
        "0",
        "--no-memory",
        "--peak-convs",
        "1,8,8,8",
        "--peak-matmul",
        "32",
        "--profile",
        "--markdown",
        "--out",
        str(out),
    )
    assert report == json.loads(out.read_text())
    assert report["threads"] == 2 and report["machine"]["cpu_capability"] and report["settings"]["cases"] == ["5x16x16"]
    rows = report["rows"]
    assert [(r["op"], r["mode"]) for r in rows] == [
        ("encode", "parallel"),
        ("encode", "sequential"),
        ("decode", "parallel"),
        ("decode", "sequential"),
    ]
    for r in rows:
        assert len(r["ours_times"]) == len(r["published_times"]) == 2
        assert all(math.isfinite(t) and t > 0 for t in r["ours_times"] + r["published_times"])
        assert r["ours_min_s"] <= r["ours_s"] and r["published_min_s"] <= r["published_s"]
        assert r["ratio"] == pytest.approx(r["published_s"] / r["ours_s"])
        assert r["max_abs_diff"] < 1e-4 and "ours_mb" not in r
        assert r["output_shape"] == ([1, 2, 16, 2, 2] if r["op"] == "encode" else [1, 5, 3, 16, 16])
        pub, ours = r["published_flops"]["conv"], r["ours_flops"]["conv"]
        # ours skips work in the decoder (upsample + conv at low resolution) and folds each TPool
        # into the next conv in the encoder (a few % more FLOPs there, one pass less)
        assert 0 < ours < pub if r["op"] == "decode" else 0.9 * pub < ours < 1.1 * pub
        assert r["published_gflops_s"] == pytest.approx(pub / r["published_s"] / 1e9)
        peak = report["roofline"]["peak_gflops"] * 1e9
        assert r["max_ratio_at_peak"] == pytest.approx(r["published_s"] / (ours / peak))
    roof = report["roofline"]
    assert roof["peak_gflops"] == max(roof["conv_peak_gflops"], roof["matmul"]["gflops"]) > 0
    profile = report["profile"]
    assert profile["case"] == "decode:parallel:5x16x16" and 0 < len(profile["top_ops"]) <= 15
    assert all(e["self_cpu_ms"] >= 0 and e["name"] for e in profile["top_ops"])
    assert 0 < sum(e["percent"] for e in profile["top_ops"]) <= 100.01
    table = [line for line in rest.splitlines() if line.startswith("| taehv |")]
    assert len(table) == 8 and table == [
        line for line in out.with_suffix(".md").read_text().splitlines() if line.startswith("| taehv |")
    ]


def test_peak_memory_in_fresh_processes():
    from bench.lib.cpu_memory import heap_in_use

    report, _ = _run("--ops", "decode", "--modes", "sequential", "--repeats", "1", "--warmup", "0", "--no-roofline")
    (row,) = report["rows"]
    for impl in ("ours", "published"):
        assert row["memory"][impl]["output_shape"] == [1, 5, 3, 16, 16] and row["memory"][impl]["baseline_mb"] > 50
        assert 0 < row[f"{impl}_mb"] < 1000
        # glibc's in-use bytes during the second call: at least its output (5 frames of 3x16x16 fp32)
        assert (row[f"{impl}_heap_mb"] is None) == (heap_in_use() is None)
        assert heap_in_use() is None or row[f"{impl}_heap_mb"] >= 5 * 3 * 16 * 16 * 4 / 2**20
    assert row["memory_ratio"] == pytest.approx(row["ours_mb"] / row["published_mb"])


def test_cases_and_a_difference_above_the_tolerance_fails(capsys):
    from bench import bench_speed

    parser_defaults = dict(cases=None, frames=None, sizes=None)
    assert bench_speed.cases_from(type("A", (), parser_defaults)()) == [
        (9, 128, 128),
        (17, 128, 128),
        (49, 128, 128),
        (9, 256, 256),
    ]
    assert bench_speed.cases_from(type("A", (), {**parser_defaults, "frames": [9, 17], "sizes": ["64x96"]})()) == [
        (9, 64, 96),
        (17, 64, 96),
    ]
    threads = torch.get_num_threads()
    try:
        code = bench_speed.main(
            [
                *TINY,
                "--ops",
                "decode",
                "--modes",
                "parallel",
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--no-memory",
                "--no-roofline",
                "--tolerance",
                "0",
            ]
        )
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    assert code == 1 and json.loads(captured.out)["all_within_tolerance"] is False
    assert "differ by more than 0 in 1 case(s): taehv decode parallel 5x16x16" in captured.err
