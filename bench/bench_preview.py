#!/usr/bin/env python3
"""What a live preview costs per step next to the pipeline's own step; prints JSON.

    python -m bench.bench_preview
    python -m bench.bench_preview --height 64 --width 64 --frames 17 --latent_frames 1

The tiny WanPipeline of the tests (bench/lib/tiny_pipelines.py: a one-layer transformer, the
TAEW2.1 architecture as ``pipe.vae``, random weights: speed does not depend on them) samples
``--steps`` steps twice per repeat: once with a callback that only reads the clock, once with
``LivePreview`` every step. Per step: the pipeline's step (the time between callbacks, the
preview's own time taken out) and the preview call (unpacking, the estimate, the conversion
and the TAE decode of the first sample), medians and minima over all steps of all repeats
(on a busy machine the minima are the steadier figures).

``bf16_estimate_error``: the same pipeline with a bf16 transformer, ``--bf16_steps`` steps,
no guidance: at chosen steps the mean absolute distance of the preview's estimate, and of
the latents as they are, to the scheduler's own ``sample - sigma * model_output`` (the
transformer's input and output caught by a hook).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.lib.harness import command_line, print_json, threads_summary, utc_now
from bench.lib.tiny_pipelines import inputs, wan_pipeline
from taehv_train.base.flags import ArgumentParser
from taehv_train.models.diffusers_vae import TAEVideoVAE, pipeline_config
from taehv_train.models.live_preview import LivePreview, denoised
from taehv_train.models.taehv import TAEHV


def sample(pipe, steps: int, size: dict, preview: LivePreview | None) -> tuple[list[float], list[float]]:
    """(the pipeline's step seconds, the preview call seconds) of one call of ``pipe``."""
    marks, previews = [time.perf_counter()], []

    def callback(pipe, step, timestep, kwargs):
        if preview is not None:
            start = time.perf_counter()
            kwargs = preview(pipe, step, timestep, kwargs)
            previews.append(time.perf_counter() - start)
        marks.append(time.perf_counter())
        return kwargs

    torch.manual_seed(0)
    pipe(
        **{**inputs("wan"), **size},
        num_inference_steps=steps,
        output_type="latent",
        callback_on_step_end=callback,
    )
    between = [b - a for a, b in zip(marks, marks[1:])]
    return [t - p for t, p in zip(between[1:], previews[1:])] if previews else between[1:], previews[1:]


def bf16_estimate_error(pipe, steps: int) -> list[dict]:
    """Per step after the first (a few of them): how far the estimate and the latents are
    from the scheduler's x0 with ``pipe``'s transformer cast to bf16 (and left so)."""
    pipe.transformer.to(torch.bfloat16)
    caught, seen = [], []
    hook = pipe.transformer.register_forward_hook(
        lambda module, args, kwargs, out: caught.append((kwargs["hidden_states"].float(), out[0].float())),
        with_kwargs=True,
    )

    def callback(pipe, step, timestep, kwargs):
        seen.append((pipe.scheduler.step_index, kwargs["latents"].float()))
        return kwargs

    torch.manual_seed(0)
    pipe(**inputs("wan"), num_inference_steps=steps, output_type="latent", callback_on_step_end=callback)
    hook.remove()
    rows = []
    for step in sorted({1, steps // 3, 2 * steps // 3, steps - 1}):
        index, latents = seen[step]
        sample, prediction = caught[step]
        exact = sample - float(pipe.scheduler.sigmas[index - 1]) * prediction
        estimate = denoised(pipe.scheduler, index, seen[step - 1], latents)
        rows.append(
            {
                "step": step,
                "estimate": round((estimate - exact).abs().mean().item(), 4),
                "latents": round((latents - exact).abs().mean().item(), 4),
                "x0_std": round(exact.std().item(), 3),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--frames", type=int, default=9, help="num_frames of the clip sampled")
    parser.add_argument("--height", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--latent_frames", type=int, default=None, help="decode only these first latent frames")
    parser.add_argument("--bf16_steps", type=int, default=30, help="steps of the bf16 estimate check")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    tae = TAEHV(variant="taew2_1").eval().requires_grad_(False)
    pipe = wan_pipeline(TAEVideoVAE(tae, pipeline_config(tae)))
    preview = LivePreview(TAEHV(variant="taew2_1").eval().requires_grad_(False), pipe, latent_frames=args.latent_frames)
    size = {"num_frames": args.frames, "height": args.height, "width": args.width}
    plain, steps, calls = [], [], []
    with torch.inference_mode():
        sample(pipe, 2, size, preview)  # warm-up
        for _ in range(args.repeats):  # the runs alternate, so a busy machine slows both alike
            plain += sample(pipe, args.steps, size, None)[0]
            step, call = sample(pipe, args.steps, size, preview)
            steps, calls = steps + step, calls + call
    step_s, preview_s = statistics.median(plain), statistics.median(calls)
    report = {
        "command": command_line("bench.bench_preview"),
        "when": utc_now(),
        "machine": threads_summary(),
        "pipeline": "WanPipeline, one-layer transformer",
        "clip": size,
        "latent_frames": args.latent_frames,
        "step_seconds": round(step_s, 5),
        "step_seconds_with_preview": round(statistics.median(steps), 5),
        "preview_seconds": round(preview_s, 5),
        "preview_per_step": round(preview_s / step_s, 3),
        "step_best_seconds": round(min(plain), 5),
        "preview_best_seconds": round(min(calls), 5),
        "preview_per_step_best": round(min(calls) / min(plain), 3),
        "preview_shape": list(preview.latest.video.shape),
        "bf16_estimate_error": bf16_estimate_error(pipe, args.bf16_steps),
    }
    print_json(report)
    return report


if __name__ == "__main__":
    main()
