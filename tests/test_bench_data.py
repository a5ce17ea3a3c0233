"""bench/bench_data.py's decoder comparison runs end to end at tiny sizes: OpenCV, PyAV and
(where it loads) torchcodec decode the loader's windows, one row per decoder and output,
every decoder's frames equal to OpenCV's at the same indices; a decoder that cannot load is
reported with its reason instead of a row."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.bench_data import Request, available_decoders, compare_to_opencv, torchcodec_unavailable
from conftest import REPO_ROOT

pytestmark = pytest.mark.slow  # a benchmark

TORCHCODEC = ("torchcodec_exact", "torchcodec_approximate")


def test_decoder_comparison_rows_and_equality(videos_dir):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.bench_data",
            "--videos_dir",
            str(videos_dir),
            "--decoders_only",
            "--decoders",
            "pyav",
            "torchcodec",
            "--decoder_windows",
            "random",
            "--clips",
            "2",
            "--repeats",
            "1",
            "--n_frames",
            "5",
            "--sizes",
            "32x32",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert "loader" not in report  # --decoders_only
    comparison = report["decoders"]
    assert comparison["threads"] == 1 and comparison["seek_threshold"] == 32
    assert comparison["windows"] == [{"window": "random", "reads": 2, "frames": 10}]

    unavailable = comparison["unavailable"]
    if torchcodec_unavailable() is None:
        expected = ["opencv", "pyav", *TORCHCODEC]
        assert unavailable == {} and comparison["versions"]["torchcodec"]
    else:
        expected = ["opencv", "pyav"]
        assert sorted(unavailable) == sorted(TORCHCODEC) and all(unavailable[name] for name in TORCHCODEC)

    rows = comparison["rows"]
    assert [(r["decoder"], r["output"]) for r in rows] == [(d, o) for o in ("source", "32x32") for d in expected]
    for row in rows:
        assert row["window"] == "random" and row["frames_per_s_per_worker"] > 0
        assert len(row["rounds_frames_per_s"]) == 1
        if row["decoder"] == "opencv":
            assert row["vs_opencv"] == 1.0

    equality = {e["decoder"]: e for e in comparison["equality"]}
    assert sorted(equality) == sorted(expected)
    assert equality["opencv"]["max_abs_diff"] == 0  # the loader's own path against the reference read
    for name in expected:
        entry = equality[name]
        assert entry["frames"] == 10 and entry["missing_frames"] == 0
        assert entry["same_frames"] and entry["closer_to_a_neighbour"] == 0
        assert entry["mean_abs_diff"] < 1.0  # same frame; colour conversions may differ by a level


@pytest.mark.parametrize(
    "clip",
    [
        "gopro_max_heromode.mp4",  # 10-frame GOPs, full-range yuvj420p, telemetry tracks
        "udacity_alf_project_video_start_200f.mp4",  # audio is stream 0, 30-frame GOPs
        "sam2_01_dog.mp4",  # one GOP of 250 frames: a seek decodes from frame 0
    ],
)
def test_pyav_seeks_to_the_frames_opencv_reads(videos_dir, clip):
    """Windows from frame 0 (no seek), just below and at the seek threshold, and far in,
    where PyAV seeks to a keyframe and counts frames from the pts."""
    decoders, _ = available_decoders(["pyav"], seek_threshold=32)
    pyav = next(d for d in decoders if d.name == "pyav")
    path = str(videos_dir / clip)
    requests = [Request(path, start, 3, 6, (1.0, 0.5, 0.5, False)) for start in (0, 20, 31, 32, 97, 150)]
    entry = compare_to_opencv(pyav, requests)
    assert entry["frames"] == 36 and entry["missing_frames"] == 0
    assert entry["same_frames"] and entry["mean_abs_diff"] < 1.0


def test_missing_torchcodec_is_reported_not_dropped(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchcodec", None)  # import torchcodec raises ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
    decoders, unavailable = available_decoders(["torchcodec"], seek_threshold=32)
    assert [d.name for d in decoders] == ["opencv"]  # OpenCV, the reference, always runs
    assert sorted(unavailable) == sorted(TORCHCODEC)
    assert all(reason.startswith("ModuleNotFoundError: ") and "torchcodec" in reason for reason in unavailable.values())
