#!/usr/bin/env python3
"""Peak memory of ``inference.py --sequential`` on one real clip as the clip gets longer,
and of its per-sample metrics computed in chunks of frames or all at once; prints JSON.

    OMP_NUM_THREADS=1 python -m bench.bench_inference_memory --frames 5 33 --height 360 --width 640

Arms:
- ``inference``: the whole ``inference.py --sequential --num_samples 1`` (random-weight
  TAEHV saved with ``save_weights``) in a fresh process; peak = its maximum RSS.
- ``metrics``: a fresh process reads the same clip (T frames at the size), adds noise for
  a "decoded" copy and computes what inference computes per sample (MSE, PSNR, per-frame
  PSNR, SSIM, temporal error), chunked (``chunk_frames=None``, the default) or unchunked
  (``chunk_frames=T``: one chunk, the computation before chunking); peak = VmHWM, growth =
  peak over the peak before the metrics (the two videos are already in memory).

This process imports no torch, so the peak RSS a child inherits at fork stays small.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.harness import REPO_ROOT, cpu_name, shared_dir
from taehv_train.base.flags import ArgumentParser  # argparse only: this process stays free of torch

DEFAULT_CLIP = shared_dir() / "videos" / "udacity_alf_project_video_start_200f.mp4"
SAVE_WEIGHTS = """
import torch
from taehv_train.models.taehv import TAEHV
from taehv_train.models.weights import save_weights
torch.manual_seed(0)
save_weights(TAEHV(variant="taehv"), {path!r})
print(torch.__version__)
"""


def run_measured(command: list[str], log: Path) -> tuple[int, float, float]:
    """(exit status, peak RSS in MB, seconds) of ``command`` in a child process; its output goes to ``log``."""
    start = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        _, status, usage = os.wait4(child.pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss / 1024, time.perf_counter() - start


def inference_run(weights: Path, clip: Path, frames: int, height: int, width: int, work: Path) -> dict:
    out = work / f"inference_T{frames}"
    command = [
        sys.executable,
        str(REPO_ROOT / "inference.py"),
        "--model_path",
        str(weights),
        "--videos",
        str(clip),
        "--n_frames",
        str(frames),
        "--height",
        str(height),
        "--width",
        str(width),
        "--sequential",
        "--num_samples",
        "1",
        "--output_dir",
        str(out),
    ]
    status, peak_mb, seconds = run_measured(command, work / f"inference_T{frames}.log")
    if status != 0:
        raise SystemExit(f"inference.py failed ({status}): see {work / f'inference_T{frames}.log'}")
    sample = json.loads((out / "metrics.json").read_text())["samples"][0]["taehv"]
    return {
        "arm": "inference",
        "frames": frames,
        "peak_rss_mb": round(peak_mb),
        "seconds": round(seconds, 1),
        "encode_s": round(sample["encode_s"], 2),
        "decode_s": round(sample["decode_s"], 2),
    }


def metrics_run(clip: Path, frames: int, height: int, width: int, chunked: bool, work: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "bench.bench_inference_memory",
        "--metrics_child",
        "--clip",
        str(clip),
        "--frames",
        str(frames),
        "--height",
        str(height),
        "--width",
        str(width),
    ] + ([] if chunked else ["--unchunked"])
    log = work / f"metrics_T{frames}_{'chunked' if chunked else 'unchunked'}.log"
    status, _, seconds = run_measured(command, log)
    if status != 0:
        raise SystemExit(f"the metrics child failed ({status}): see {log}")
    return {
        "arm": "metrics",
        "metrics": "chunked" if chunked else "unchunked",
        "frames": frames,
        **json.loads(log.read_text().strip().splitlines()[-1]),
        "seconds": round(seconds, 1),
    }


def metrics_child(clip: Path, frames: int, height: int, width: int, unchunked: bool) -> None:
    """Print the peak memory of inference's per-sample metrics on ``clip`` (run in a fresh process)."""
    import torch  # here, not at the top: the parent stays small (see the module docstring)

    from taehv_train.common.clips import VideoClipDataset, frames_to_unit
    from taehv_train.common.metrics import frame_psnr, video_mse, video_psnr, video_ssim, video_temporal_error
    from taehv_train.training.loop.monitoring import peak_rss_bytes

    with tempfile.TemporaryDirectory() as folder:
        annotation = Path(folder) / "clip.json"
        annotation.write_text(json.dumps({"list": [{"full_path": str(clip)}]}))
        dataset = VideoClipDataset(
            annotation_file=annotation,
            n_frames=frames,
            height=height,
            width=width,
            mode="val",
            stride_range=(1, 1),
            crop_scale=(1.0, 1.0),
        )
        target = frames_to_unit(dataset.load_clip(0).unsqueeze(0), "cpu")
    decoded = (target + 0.03 * torch.randn(target.shape, generator=torch.Generator().manual_seed(0))).clamp_(0, 1)
    chunk = frames if unchunked else None
    with torch.inference_mode():
        before = peak_rss_bytes()
        for metric in (video_mse, video_psnr, frame_psnr, video_ssim, video_temporal_error):
            metric(decoded, target, chunk_frames=chunk)
        peak = peak_rss_bytes()
    print(
        json.dumps(
            {
                "peak_rss_mb": round(peak / 2**20),
                "growth_mb": round((peak - before) / 2**20),
                "videos_mb": round(2 * target.numel() * 4 / 2**20),
            }
        )
    )


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, nargs="+", default=[5, 33])
    parser.add_argument("--height", type=int, default=360)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--clip", type=Path, default=DEFAULT_CLIP, help="a real clip with enough frames")
    parser.add_argument("--arms", nargs="+", choices=["inference", "metrics"], default=["inference", "metrics"])
    parser.add_argument("--metrics_child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--unchunked", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.metrics_child:
        metrics_child(args.clip, args.frames[0], args.height, args.width, args.unchunked)
        return

    work = Path(tempfile.mkdtemp(prefix="bench_inference_memory_"))
    print(f"outputs and logs in {work}", file=sys.stderr)
    weights = work / "taehv.safetensors"
    torch_version = subprocess.run(
        [sys.executable, "-c", SAVE_WEIGHTS.format(path=str(weights))], check=True, capture_output=True, text=True
    ).stdout.strip()
    runs = []
    for frames in args.frames:
        if "inference" in args.arms:
            runs.append(inference_run(weights, args.clip, frames, args.height, args.width, work))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
        if "metrics" in args.arms:
            for chunked in (False, True):
                runs.append(metrics_run(args.clip, frames, args.height, args.width, chunked, work))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    machine = {
        "python": platform.python_version(),
        "torch": torch_version,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    print(
        json.dumps(
            {
                "benchmark": "inference_memory",
                "machine": machine,
                "clip": args.clip.name,
                "size": f"{args.height}x{args.width}",
                "runs": runs,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
