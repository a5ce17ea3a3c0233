#!/usr/bin/env python3
"""Probing for annotations: the full decode against the count from packets; prints JSON.

    python -m bench.bench_annotate --videos_dir ../shared/videos --repeats 5

``probe_video`` (what ``python -m taehv_train.training.make_annotations`` calls per file) learns a
video's length either by decoding every frame with OpenCV (``exact_decode=True``) or, for
H.264/HEVC whose packets prove it, by counting packets (``count_frames_from_packets``).
In a temporary folder this benchmark copies the videos of ``--videos_dir`` and writes
damaged copies of each (``damaged_copies``: cut at 30/60/90 % of its bytes, 4 KB of zeros
at 50 %, the first 64 bytes zeroed, 64 bytes of its MP4 index zeroed) and two files that
are no video (text named .mp4, a clip's audio alone in an MP4). Then, in this process:

- per file, ``probe_video`` both ways (median of ``--repeats`` rounds, one OpenCV/FFmpeg
  thread, the two ways alternating): seconds per file for the intact videos and for the
  damaged ones, the speed-up, whether both ways give the same result (frames, fps, size
  or the same skip reason), how each file was counted ("packets", "full decode" and why,
  or "refused" when OpenCV does not open it), the seconds OpenCV takes to open it, which
  both ways pay (the floor of a probe), and the seconds checking the packets adds to a
  file then decoded (``full_decode_extra_s_per_file``);
- ``make_annotations`` on the whole folder (``--workers`` probing processes) with each
  way, timed (median of ``--repeats``), and whether the train/val/skipped files it
  writes are identical.

Exit status 1 when any result or annotation file differs between the two ways.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import statistics
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from unittest import mock

import av

from bench.lib.harness import command_line, cpus_summary, print_json, shared_dir, timed
from taehv_train.base.flags import ArgumentParser
from taehv_train.common.video.files import BadClipError, find_videos
from taehv_train.common.video.packet_count import count_frames_from_packets
from taehv_train.common.video.probe import VideoInfo, probe_video
from taehv_train.common.video.reader import VideoReader
from taehv_train.training import make_annotations
from taehv_train.training.annotate import probe_pool
from taehv_train.training.annotate.annotation_files import output_paths

Result = VideoInfo | str  # what probe_video gives, or the skip reason it raises


def top_level_box(data: bytes, kind: bytes) -> tuple[int, int] | None:
    """(offset, size) of the first top-level ISO-BMFF box ``kind`` ('moov') of ``data``."""
    pos = 0
    while pos + 8 <= len(data):
        size, name = struct.unpack(">I4s", data[pos : pos + 8])
        if size == 1 and pos + 16 <= len(data):
            size = struct.unpack(">Q", data[pos + 8 : pos + 16])[0]
        elif size == 0:
            size = len(data) - pos
        if name == kind:
            return pos, size
        if size < 8:
            return None
        pos += size
    return None


def damaged_copies(source: Path, folder: Path) -> list[Path]:
    """Damaged copies of ``source`` written to ``folder`` as ``<stem>_<damage><suffix>``:
    cut at 30, 60 and 90 % of its bytes (a download that stopped), 4 KB of zeros at 50 %
    (a hole in a file), its first 64 bytes zeroed (the header), and for an MP4/MOV 64 bytes
    zeroed in the middle of its index (the 'moov' box)."""
    data = source.read_bytes()
    damaged: dict[str, bytes] = {f"cut{p}": data[: len(data) * p // 100] for p in (30, 60, 90)}
    middle = len(data) // 2
    damaged["zeros50"] = data[:middle] + bytes(min(4096, len(data) - middle)) + data[middle + 4096 :]
    damaged["header"] = bytes(min(64, len(data))) + data[64:]
    if (moov := top_level_box(data, b"moov")) is not None:
        at = moov[0] + moov[1] // 2
        damaged["index"] = data[:at] + bytes(64) + data[at + 64 :]
    paths = []
    for damage, content in damaged.items():
        paths.append(folder / f"{source.stem}_{damage}{source.suffix}")
        paths[-1].write_bytes(content)
    return paths


def write_audio_alone(source: Path, path: Path) -> bool:
    """The audio stream of ``source`` copied alone into ``path`` (an MP4 without video);
    False when ``source`` has no audio."""
    with av.open(str(source)) as container:
        if not container.streams.audio:
            return False
        audio = container.streams.audio[0]
        with av.open(str(path), "w") as out:
            stream = out.add_stream_from_template(audio)
            for packet in container.demux(audio):
                if packet.dts is not None:
                    packet.stream = stream
                    out.mux(packet)
    return True


def probe(path: Path, exact_decode: bool) -> Result:
    try:
        return probe_video(path, exact_decode=exact_decode)
    except BadClipError as err:
        return str(err)


def route(path: Path) -> tuple[str, str, float, float]:
    """How ``probe_video`` counts ``path``'s frames ("packets", "full decode" and why, or
    "refused": OpenCV does not open it), the seconds OpenCV takes to open it (the part of a
    probe both ways pay) and the seconds the packets take to check (what a file left to
    the full decode costs on top of it)."""
    start = time.perf_counter()
    try:
        reader = VideoReader(str(path))
    except BadClipError:
        return "refused", "", time.perf_counter() - start, 0.0
    with reader:
        opened = time.perf_counter() - start
        checked, count = timed(lambda: count_frames_from_packets(str(path), reader.container_frame_count))
    return ("full decode" if count.unproven else "packets"), count.unproven, opened, checked


def probe_rows(paths: list[Path], repeats: int) -> list[dict]:
    """Per file: both results, their median seconds over ``repeats`` alternating rounds,
    and why the packet count decodes it."""
    rows = []
    for path in paths:
        seconds: dict[bool, list[float]] = {True: [], False: []}
        results: dict[bool, Result] = {}
        for round_ in range(repeats):
            for exact in (True, False) if round_ % 2 == 0 else (False, True):
                elapsed, results[exact] = timed(functools.partial(probe, path, exact))
                seconds[exact].append(elapsed)
        full, fast = (statistics.median(seconds[e]) for e in (True, False))
        counted, why, opened, checked = route(path)
        rows.append(
            {
                "file": path.name,
                "result": str(results[True]),
                "same": results[True] == results[False],
                "full_decode_s": round(full, 5),
                "packet_count_s": round(fast, 5),
                "opencv_open_s": round(opened, 5),
                "packet_check_s": round(checked, 5),
                "speedup": round(full / fast, 1),
                "counted_by": counted,
                "why": why,
            }
        )
    return rows


def summary(rows: list[dict]) -> dict:
    full = sum(r["full_decode_s"] for r in rows) / max(len(rows), 1)
    fast = sum(r["packet_count_s"] for r in rows) / max(len(rows), 1)
    opened = sum(r["opencv_open_s"] for r in rows) / max(len(rows), 1)
    decoded = [r for r in rows if r["counted_by"] == "full decode"]
    return {
        "files": len(rows),
        "full_decode_s_per_file": round(full, 5),
        "packet_count_s_per_file": round(fast, 5),
        "opencv_open_s_per_file": round(opened, 5),
        "speedup": round(full / fast, 1) if fast else None,
        "speedup_per_file_min": min((r["speedup"] for r in rows), default=None),
        "counted_by": dict(Counter(r["counted_by"] for r in rows)),
        "full_decode_extra_s_per_file": round(sum(r["packet_check_s"] for r in decoded) / max(len(decoded), 1), 5),
        "why_full_decode": dict(Counter(r["why"] for r in rows if r["why"])),
    }


def annotate(folder: Path, out: Path, workers: int, exact_decode: bool) -> tuple[float, int, dict[str, str]]:
    """Seconds, exit status and the three files of ``make_annotations`` on ``folder``, with
    ``probe_video``'s full decode (``exact_decode``) or its packet count. ``out`` must be in
    a new folder: the tool would reuse the probe records of an earlier run next to it."""
    argv = [str(folder), "-o", str(out), "--workers", str(workers)]
    probe_as = functools.partial(probe_video, exact_decode=exact_decode)
    with (
        mock.patch.object(probe_pool, "probe_video", probe_as),  # forked workers inherit it
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),  # the progress bar
    ):
        elapsed, status = timed(lambda: make_annotations.main(argv))
    files = {part: path.read_text() for part, path in output_paths(out).items()}
    return elapsed, int(status), files


def main() -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--videos_dir", type=Path, default=shared_dir() / "videos", help="the intact videos (default: %(default)s)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds per measurement (medians)")
    parser.add_argument("--workers", type=int, default=1, help="make_annotations' probing processes")
    args = parser.parse_args()
    if args.repeats < 1 or args.workers < 1:
        parser.error("--repeats and --workers must be 1 or more")
    sources = [args.videos_dir / p for p in find_videos(args.videos_dir)]
    if not sources:
        parser.error(f"no videos under {args.videos_dir}")

    with tempfile.TemporaryDirectory(prefix="bench_annotate_") as tmp:
        folder = Path(tmp) / "clips"
        folder.mkdir()
        intact = []
        for source in sources:
            intact.append(folder / source.name)
            intact[-1].write_bytes(source.read_bytes())
        damaged = [path for source in intact for path in damaged_copies(source, folder)]
        (folder / "notes.mp4").write_text("not a video\n" * 100)
        damaged.append(folder / "notes.mp4")
        with_audio = next((s for s in intact if write_audio_alone(s, folder / f"{s.stem}_audio_alone.mp4")), None)
        if with_audio is not None:
            damaged.append(folder / f"{with_audio.stem}_audio_alone.mp4")

        intact_rows, damaged_rows = probe_rows(intact, args.repeats), probe_rows(damaged, args.repeats)
        runs: dict[bool, list[float]] = {True: [], False: []}
        outputs: dict[bool, dict[str, str]] = {}
        status: dict[bool, int] = {}
        for round_ in range(args.repeats):
            for exact in (True, False) if round_ % 2 == 0 else (False, True):
                out = Path(tmp) / f"run{round_}_{'full' if exact else 'packets'}" / "a.json"
                elapsed, status[exact], outputs[exact] = annotate(folder, out, args.workers, exact)
                runs[exact].append(elapsed)
        files = len(intact) + len(damaged)
        full, fast = (statistics.median(runs[e]) for e in (True, False))
        same_results = all(r["same"] for r in intact_rows + damaged_rows)
        identical = outputs[True] == outputs[False] and status[True] == status[False]
        kept = sum(json.loads(outputs[True][part])["total"] for part in ("train", "val"))
        result = {
            "command": command_line("bench.bench_annotate"),
            "machine": cpus_summary(),
            "videos_dir": str(args.videos_dir),
            "repeats": args.repeats,
            "probe_intact": summary(intact_rows),
            "probe_damaged": summary(damaged_rows),
            "same_probe_results": same_results,
            "make_annotations": {
                "files": files,
                "kept": kept,
                "workers": args.workers,
                "full_decode_s_per_file": round(full / files, 5),
                "packet_count_s_per_file": round(fast / files, 5),
                "speedup": round(full / fast, 1),
                "exit_status": status[False],
                "identical": identical,
            },
            "intact": intact_rows,
            "damaged": damaged_rows,
        }
    print_json(result)
    return 0 if same_results and identical else 1


if __name__ == "__main__":
    sys.exit(main())
