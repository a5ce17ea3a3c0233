#!/usr/bin/env python3
"""The training forward + backward, ours against the published implementation, same
weights, one process; prints JSON (and a Markdown table with ``--markdown``).

    python -m bench.bench_train_speed                        # the three default cases, fp32 and bf16
    python -m bench.bench_train_speed --cases 4x13x64x64 --dtypes fp32 --repeats 9
    python -m bench.bench_train_speed --device cuda --cases 2x17x256x256 1x17x480x720
    python -m bench.bench_train_speed --device cuda --cases 2x17x480x720 --dtypes bf16 --out speed.json  # gpu_check's

Each case (batch x frames x height x width) runs the reconstruction objective
``MSE(decode(encode(x)), x[:, :decoded])`` and its backward pass:

* ours: ``TAEHV.forward`` (``encode_video`` + ``decode_video(clamp=False)``), the call the
  training step makes, in ``.train()``;
* published: ``encode_video`` + ``apply_model_with_memblocks`` over the decoder, trimmed as
  its ``decode_video`` trims (without its in-place clamp).

Weights: ours seeded, saved under the published file name and loaded by the published
constructor (``bench.lib.published_model.build_pair``). Timing: ``--warmup`` calls of each, then
``--repeats`` calls alternating ours and the published; medians; ``ratio`` = published /
ours (CUDA synchronised after each call). ``bf16`` runs both under ``torch.autocast``
in bfloat16 (on CPU fast with AVX512-BF16 or AMX). Gradients: after the last timed call, the largest relative
difference (norm of the difference over the published norm) over all parameters, and
the loss difference.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.lib.harness import device_label, load_published, machine_info, print_json, published_file, time_alternating
from bench.lib.published_model import build_pair, published_loss

DEFAULT_CASES = ("4x13x64x64", "2x9x32x48", "1x17x128x128")


def ours_loss(model, x: torch.Tensor) -> torch.Tensor:
    decoded = model(x).decoded
    return F.mse_loss(decoded, x[:, : decoded.shape[1]])


def step(model, loss_fn, x: torch.Tensor, bf16: bool):
    """One forward + backward; returns the loss (gradients stay on the parameters)."""

    def run() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            loss = loss_fn(model, x)
        loss.backward()
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        return loss.detach()

    return run


def gradient_difference(ours, published) -> float:
    theirs = dict(published.named_parameters())
    return max(
        ((p.grad - theirs[name].grad).norm() / theirs[name].grad.norm()).item() for name, p in ours.named_parameters()
    )


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    module = load_published(args.published or published_file(args.variant))
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        ours, published, _ = build_pair(args.variant, Path(workdir), published_path=args.published)
        ours.to(device).train()
        published.to(device).train()
        for case in args.cases:
            batch, frames, height, width = (int(v) for v in case.split("x"))
            x = torch.rand(batch, frames, 3, height, width, generator=torch.Generator().manual_seed(0)).to(device)
            for dtype in args.dtypes:
                bf16 = dtype == "bf16"
                ours_times, pub_times, ours_out, pub_out = time_alternating(
                    step(ours, ours_loss, x, bf16),
                    step(published, lambda m, v: published_loss(module, m, v), x, bf16),
                    args.warmup,
                    args.repeats,
                )
                row = {
                    "case": case,
                    "dtype": dtype,
                    "ours_s": round(statistics.median(ours_times), 4),
                    "published_s": round(statistics.median(pub_times), 4),
                    "loss_diff": abs(ours_out.item() - pub_out.item()),
                    "max_grad_rel_diff": gradient_difference(ours, published),
                }
                row["ratio"] = round(row["published_s"] / row["ours_s"], 3)
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    return {
        "machine": machine_info(),
        "device": device_label(device),
        "torch": torch.__version__,
        "variant": args.variant,
        "threads": args.threads,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "rows": rows,
    }


def markdown(report: dict) -> str:
    lines = [
        "| case (NxTxHxW) | dtype | ours s | published s | ratio | loss diff | max grad rel diff |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['case']} | {r['dtype']} | {r['ours_s']:.3f} | {r['published_s']:.3f} | {r['ratio']:.2f} "
            f"| {r['loss_diff']:.1e} | {r['max_grad_rel_diff']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variant", default="taehv")
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="NxTxHxW")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument(
        "--published", type=Path, help="the published taehv.py (default: ../shared/reference's, TAEHV_SHARED_DIR)"
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    report = run(args)
    print_json(report, out=args.out)
    if args.markdown:
        print(markdown(report))


if __name__ == "__main__":
    main()
