"""bench/bench_annotate.py runs end to end on small generated clips and their damaged
copies: probe_video's two ways (full decode, count from packets) give the same results,
make_annotations writes the same files with either, and the report says how each file
was counted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_packet_count import write_encoded_clip

from conftest import REPO_ROOT

pytestmark = pytest.mark.slow  # a benchmark process


def test_both_ways_give_identical_annotations(tmp_path):
    clips = tmp_path / "clips"
    clips.mkdir()
    write_encoded_clip(clips / "bframes.mp4", "libx264", options={"bframes": "3", "b-pyramid": "normal"})
    write_encoded_clip(clips / "hevc.mkv", "libx265", options={"x265-params": "log-level=error"})
    write_encoded_clip(clips / "vp9.webm", "libvpx-vp9", options={"deadline": "realtime", "cpu-used": "8"})
    result = subprocess.run(
        [sys.executable, "-m", "bench.bench_annotate", "--videos_dir", str(clips), "--repeats", "1"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["same_probe_results"] and report["make_annotations"]["identical"]
    assert report["probe_intact"]["counted_by"] == {"packets": 2, "full decode": 1}  # VP9 is decoded
    assert report["probe_intact"]["why_full_decode"] == {"codec vp9: only H.264 and HEVC are counted from packets": 1}
    damaged = report["probe_damaged"]
    # cut at 30/60/90 %, zeros, header (and index: MP4 only) of each, and a text file
    assert damaged["files"] == len(report["damaged"]) == 6 + 5 + 5 + 1
    assert damaged["counted_by"]["refused"] >= 3 and damaged["counted_by"]["full decode"] >= 3
    row = next(r for r in report["intact"] if r["file"] == "bframes.mp4")
    assert row["same"] and row["counted_by"] == "packets" and "frames=30" in row["result"]
    assert report["make_annotations"]["kept"] >= 3
