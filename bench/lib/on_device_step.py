#!/usr/bin/env python3
"""The training step a run builds, fed batches that are already on the device: the ceiling
that bench/bench_gpu.py holds the launch script's own speed against. Started as the launch
script starts training, one process:

    python -m taehv_train.training.launch --config_file accelerate_configs/deepspeed_1gpu.yaml --num_processes 1 \\
        -m bench.lib.on_device_step --config training/configs/taehv_config_1gpu_h100.py --out row.json [--key=value ...]
    python -m taehv_train.training.launch --use_deepspeed --zero_stage 2 --num_machines 1 --num_processes 1 \\
        -m bench.lib.on_device_step --config ... --out row.json    # without CUDA: DeepSpeed on the CPU (gloo)

Built as ``training/taehv_train.py`` builds it: the config file with the same
``--key=value`` overrides, the Accelerator of ``training.loop.accelerator.make_accelerator``
(under the launch above: DeepSpeed ZeRO-2; ``mixed_precision=bf16`` there means bf16
weights with no autocast, the engine stepped by the training step once the window is agreed),
``training.loop.forward.build_model`` and ``TrainStep.build`` with the training loader
prepared with it (``build_train_loader``: pinned batches on CUDA), ``torch.compile`` as
``compile`` says, cuDNN's benchmark mode left as training leaves it (off). Its batches:
the loader's first accumulation window, received as training receives them (the
prefetching thread copies pinned batches to the GPU on a side stream), then kept on the
device and cycled, so no timed step copies or waits for data. No reference VAE is loaded:
with a latent cache (``latent_cache_dir``) the batches carry the reference latents and
the step never runs it.

Timing: ``--warmup`` windows (the first compiles), then windows for ``--seconds``, CUDA
synchronised at both ends. ``--out`` gets one JSON object: clips/s, frames/s, the TAE's
training TFLOP/s and MFU (``training.loop.feed``; null on a CPU or an unknown GPU), the
step's waits for data and the GPU's idle time (its ``IdleClock``; null on a CPU) as shares
of the wall time, the optimizer steps, the last loss, the peak GPU memory, and how the
engine was built (distributed type, ZeRO stage, the weights' dtype, the optimizer, cuDNN's
benchmark mode, pinned memory, compiled or not).
"""

from __future__ import annotations

import itertools
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate.utils import set_seed

from bench.lib.gpu_measure import GraphCount
from taehv_train.base.errors import exit_on_user_error
from taehv_train.base.flags import ArgumentParser
from taehv_train.common.config import TrainConfig, load_config
from taehv_train.evaluation.timing import synchronize
from taehv_train.training.data.loading import build_train_loader, build_training_data
from taehv_train.training.data.prefetch import Prefetcher
from taehv_train.training.loop.accelerator import make_accelerator
from taehv_train.training.loop.feed import micro_batch_flops, peak_flops
from taehv_train.training.loop.forward import build_model
from taehv_train.training.loop.optimisation import compiles
from taehv_train.training.loop.progress import Progress
from taehv_train.training.loop.step import StepResult, TrainStep
from taehv_train.training.preflight import check


def device_window(step: TrainStep, loader, config: TrainConfig) -> list[dict]:
    """The prepared loader's first accumulation window, received as training receives it
    (the prefetching thread), on the device."""
    fetched = Prefetcher(loader, step.accelerator, Progress(), config.prefetch_batches)
    try:
        batches = [next(fetched).batch for _ in range(config.gradient_accumulation_steps)]
    finally:
        fetched.close()
    synchronize(step.accelerator.device)
    for batch in batches:
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.device != step.accelerator.device:
                raise RuntimeError(f"batch[{key!r}] is on {value.device}, not on {step.accelerator.device}")
    return batches


def run_windows(step: TrainStep, feed: Iterator, warmup: int, seconds: float) -> dict:
    """Accumulation windows of ``step`` fed from ``feed``: ``warmup`` of them (the first
    compiles when the config compiles), then as many as start within ``seconds``; the wall
    time of those (CUDA synchronised) and what they trained, waited and idled."""
    device = step.accelerator.device
    numbers = itertools.count(1)

    def window() -> StepResult:
        result = step(feed, next(numbers))
        if not result.applied:
            raise RuntimeError(f"training step skipped its optimizer step: {result.skip_reason or result.data_error}")
        return result

    graphs = GraphCount()
    warm_started = time.perf_counter()
    for _ in range(warmup):
        window()
    synchronize(device)
    warmup_seconds = time.perf_counter() - warm_started
    step.idle.take_seconds()  # the warm-up's gaps
    warmup_graphs = graphs.step()
    results = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        results.append(window())
    synchronize(device)
    return {
        "seconds": time.perf_counter() - started,
        "warmup_seconds": warmup_seconds,
        "steps": len(results),
        "micro_batches": sum(result.micro_batches for result in results),
        "data_wait": sum(result.data_wait for result in results),
        "idle": step.idle.take_seconds(),
        "last_loss": float(results[-1].losses[-1]["loss"]),
        "graphs_compiled_warmup": warmup_graphs,
        "graphs_compiled_timed": graphs.step(),
    }


def figures(config: TrainConfig, device: torch.device, run: dict) -> dict:
    """Rates of ``run_windows``' windows: clips and frames per second, the TAE's training
    TFLOP/s and MFU (None where the GPU's peak is unknown), and the shares of wall time the
    step waited for data and the GPU idled (None on a CPU)."""
    seconds, clips = run["seconds"], run["micro_batches"] * config.train_batch_size
    tflops = run["micro_batches"] * micro_batch_flops(config) / seconds / 1e12
    peak = peak_flops(device, config.mixed_precision)
    return {
        "seconds": round(seconds, 2),
        "warmup_seconds": round(run["warmup_seconds"], 2),
        "steps": run["steps"],
        "micro_batches": run["micro_batches"],
        "clips_per_s": round(clips / seconds, 3),
        "frames_per_s": round(clips * config.n_frames / seconds, 2),
        "tflops": round(tflops, 4),
        "mfu": None if peak is None else round(tflops * 1e12 / peak, 4),
        "data_wait": round(run["data_wait"] / seconds, 4),
        "gpu_idle": None if run["idle"] is None else round(run["idle"] / seconds, 4),
        "last_loss": run["last_loss"],
        "graphs_compiled_warmup": run["graphs_compiled_warmup"],
        "graphs_compiled_timed": run["graphs_compiled_timed"],
    }


def engine(step: TrainStep, loader) -> dict:
    """How the step was built: what a reader checks against the launch script's run."""
    accelerator = step.accelerator
    plugin = accelerator.state.deepspeed_plugin
    inner = getattr(step.optimizer, "optimizer", step.optimizer)  # Accelerate's wrapper around the engine's
    return {
        "distributed_type": str(accelerator.distributed_type).rsplit(".", 1)[-1],
        "zero_stage": None if plugin is None else plugin.zero_stage,
        "processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "weights_dtype": str(step.input_dtype).removeprefix("torch."),
        "optimizer": type(inner).__name__,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "pin_memory": bool(getattr(loader, "pin_memory", False)),
        "device": str(accelerator.device),
    }


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the training config file (a preset)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON row goes here")
    parser.add_argument("--seconds", type=float, default=30.0, help="timed seconds after the warm-up (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="windows before timing, the first compiles (default 3)")
    args, overrides = parser.parse_known_args(argv)
    config = load_config(args.config, overrides)
    check(config)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="on_device_step_") as run_dir:
        accelerator = make_accelerator(config, Path(run_dir))
        set_seed(config.seed)
        device = accelerator.device
        data = build_training_data(config, None)
        step, loader = TrainStep.build(
            config,
            accelerator,
            build_model(config),
            data.latents,
            loader=build_train_loader(data.train, config, device, processes=1),
        )
        step.model.train()
        batches = device_window(step, loader, config)
        setup_seconds = time.perf_counter() - started
        run = run_windows(step, itertools.cycle(batches), args.warmup, args.seconds)
        row = {
            "feed": "cached" if data.latents.cached else "plain",
            "compile": config.compile,
            "compiled": compiles(config),
            "setup_seconds": round(setup_seconds, 1),
            **figures(config, device, run),
            "gpu_memory_gb": (
                round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
            ),
            "engine": engine(step, loader),
            "batches": f"the loader's first {len(batches)} (one window), on the device, cycled",
        }
        if accelerator.is_main_process:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(row, indent=1) + "\n")
        print(json.dumps(row), file=sys.stderr, flush=True)
        accelerator.end_training()


if __name__ == "__main__":
    exit_on_user_error(main)
