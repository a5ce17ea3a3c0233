#!/usr/bin/env python3
"""Data-parallel scaling: training throughput with 1 and 2 (or more) processes, under DDP
and DeepSpeed ZeRO-2; prints JSON.

    python -m bench.bench_scaling --processes 1 2 --steps 30                  # CPU, gloo, DDP
    python -m bench.bench_scaling --processes 2 --strategies ddp zero2        # ZeRO-2 against DDP

Runs the real training script (``training/taehv_train.py``, from-scratch preset: taecvx from
scratch on procedural clips, no reference VAE) for ``--steps`` optimizer steps per
process count, with the same per-process batch (weak scaling), logging every step and no
validation or checkpoints in the timed window. ``samples_per_s`` is the median of the
loop's own ``train/samples_per_second`` over the steps after ``--skip`` warm-up steps
(read back from its TensorBoard events); ``efficiency`` is samples/s per process over the
1-process figure of the same strategy. ``final_loss`` (the last logged training loss) and
``val_psnr`` (the held-out validation at the last step) say whether two strategies
trained the same model. On CPU one process uses all cores (torch threads) and N processes
split them (``--num_cpu_threads_per_process``), so the CPU rows show the cost of the
gradient all-reduce and the process split, not added hardware.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
from bench.lib.harness import cuda_name, print_json
from taehv_train.base.flags import ArgumentParser
from taehv_train.training.demo_data import make_demo_dataset

TRAIN = ["-m", "taehv_train.training.taehv_train"]
SCRATCH_CONFIG = REPO / "training" / "configs" / "taehv_config_scratch.py"
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))


STRATEGIES = ("ddp", "zero2")


def launcher(processes: int, strategy: str, threads: int, port: int) -> list[str]:
    deepspeed = strategy == "zero2"
    if processes == 1 and not deepspeed:
        return [sys.executable]
    args = [
        ACCELERATE,
        "launch",
        "--num_machines",
        "1",
        "--num_processes",
        str(processes),
        "--main_process_port",
        str(port),
        "--num_cpu_threads_per_process",
        str(threads),
    ]
    return args + (["--use_deepspeed", "--zero_stage", "2"] if deepspeed else ["--multi_gpu"])


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir / "logs"), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def run(processes: int, strategy: str, args: argparse.Namespace, data: dict, work: Path) -> dict:
    out = work / f"{strategy}{processes}"
    cpu = not torch.cuda.is_available()
    threads = max(1, (os.cpu_count() or 1) // processes)
    command = [
        *launcher(processes, strategy, threads, 29500 + processes),
        *TRAIN,
        "--config",
        str(SCRATCH_CONFIG),
        f"--output_dir={out}",
        "--run_name=run",
        f"--data_root={data['root']}",
        f"--annotation_file={data['train']}",
        f"--val_annotation_file={data['val']}",
        f"--max_train_steps={args.steps}",
        "--log_every=1",
        f"--validation_every={10 * args.steps}",
        f"--image_log_every={10 * args.steps}",
        f"--checkpointing_steps={10 * args.steps}",
        f"--train_batch_size={args.batch_size}",
        f"--dataloader_num_workers={args.workers}",
        f"--height={args.height}",
        f"--width={args.width}",
        f"--n_frames={args.frames}",
    ]
    # DeepSpeed needs no flag for gloo (training/loop/distributed.py)
    ddp_on_cpu = cpu and processes > 1 and strategy == "ddp"
    env = {**os.environ, **({"ACCELERATE_USE_CPU": "true"} if ddp_on_cpu else {})}
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env)
    if result.returncode != 0:
        raise SystemExit(
            f"{strategy} with {processes} process(es) failed (exit {result.returncode}):\n{result.stderr[-4000:]}"
        )
    rates = [value for step, value in scalars(out / "run", "train/samples_per_second") if step > args.skip]
    return {
        "strategy": strategy,
        "processes": processes,
        "threads_per_process": threads,
        "steps_timed": len(rates),
        "samples_per_s": round(statistics.median(rates), 3),
        "final_loss": round(scalars(out / "run", "train/loss")[-1][1], 5),
        "val_psnr": round(scalars(out / "run", "val/psnr")[-1][1], 3),
    }


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=["ddp"], help="ddp, zero2 (DeepSpeed)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    parser.add_argument("--batch_size", type=int, default=4, help="per process")
    parser.add_argument("--workers", type=int, default=0, help="data-loader workers per process")
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = make_demo_dataset(
            work / "data", num_clips=16, n_frames=max(args.frames, 12), height=args.height, width=args.width, seed=0
        )
        data = {"root": work / "data", **data}
        rows = [run(p, strategy, args, data, work) for strategy in args.strategies for p in args.processes]
    for strategy in args.strategies:
        own = [row for row in rows if row["strategy"] == strategy]
        base = own[0]["samples_per_s"] / own[0]["processes"]
        for row in own:
            row["efficiency"] = round(row["samples_per_s"] / row["processes"] / base, 3)
    machine = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cuda": cuda_name(),
    }
    print_json({"benchmark": "scaling", "machine": machine, "config": vars(args), "runs": rows}, indent=2)


if __name__ == "__main__":
    main()
