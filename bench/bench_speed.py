#!/usr/bin/env python3
"""Our TAEHV against the published implementation on CPU: speed, peak memory, outputs and
the roofline, with the same weights, in one command; prints JSON.

    python -m bench.bench_speed --markdown                   # the target cases (make bench-speed)
    python -m bench.bench_speed --variants taehv1_5 --cases 9x128x128 --no_memory
    python -m bench.bench_speed --frames 17 --sizes 128x128 --profile --no_roofline

The published implementation is ``taehv_published.py`` (``taehv_published_wide.py`` for
taeltx2_3_wide) of the shared folder (``../shared/reference`` next to the repository,
``TAEHV_SHARED_DIR`` overrides ``../shared``), imported by path, never copied. Weights:
ours is ``TAEHV(variant=v)`` (seeded random init), saved under the published file name
(``taecvx.pth``, ...) and loaded by the published constructor, which picks the
architecture from that name. Both run ``.eval()`` under ``torch.inference_mode()``, fp32,
batch 1, ``--threads`` torch threads (default 2).

Cases: ``--cases TxHxW ...``, or the product of ``--frames`` and ``--sizes``; by default
the target cases: T = 9, 17, 49 at 128x128 and T = 9 at 256x256. For each case, op
(encode, decode) and mode (parallel, sequential):

* time: after ``--warmup`` calls of each, ``--repeats`` calls alternating ours and the
  published (ours, published, ours, ...) in this one process; medians and minima;
  ``ratio`` = published median / our median. Encode input: ``torch.rand`` frames
  (seeded); decode input: the published encoder's latents of those frames.
* outputs: max |ours - published| of the last timed calls; any case above
  ``--tolerance`` (1e-4) makes the command exit 1 (after printing the JSON).
* memory (``--no_memory`` skips it): each (implementation, op, mode, case) in a fresh
  spawned process: the model and the input loaded, one warm-up call, then the peak RSS
  (VmHWM, reset through /proc/self/clear_refs after the warm-up where the kernel allows)
  of one call minus the RSS before the warm-up (``*_mb``: the first call's footprint,
  with what a library sets up once, e.g. oneDNN's kernels, and what the allocator keeps),
  and the peak of the bytes malloc'ed and not freed during the second call, sampled every
  0.2 ms through glibc's mallinfo2 (``*_heap_mb``: what a call really needs, whatever
  the allocator keeps). ``memory_ratio`` = ours / published of the first, ``heap_ratio``
  of the second.
* roofline (``--no_roofline`` skips it): this CPU's measured peak (large fp32 3x3
  convolutions in channels_last and a large matmul at ``--threads``; the maximum), the
  convolution FLOPs (2 x MACs, as ``torch.utils.flop_counter.FlopCounterMode`` counts
  them; our fused oneDNN convolutions counted by the same rule) of the published call and
  of ours (ours may need fewer for the same output), the achieved GFLOP/s of both on the
  published FLOPs and their fraction of the peak, and ``max_ratio_at_peak`` =
  published seconds / (our FLOPs / peak): the ratio if ours ran at the measured peak.

``--profile`` runs ``torch.profiler`` on ours for ``--profile_case`` (``op:mode:TxHxW``,
default the first decode case, parallel) and reports the top 15 ops by self CPU time.
``--markdown`` prints a Markdown table after the JSON (for docs/benchmarks.md; with
``--out FILE`` also written to FILE with the suffix ``.md``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

import taehv_train.models.taehv as taehv_module
from bench.lib.cpu_memory import measure_memory
from bench.lib.harness import machine_info, print_json, published_file, time_alternating, utc_now
from bench.lib.published_model import build_pair, operation
from bench.lib.roofline import add_roofline, count_flops, measure_peak
from taehv_train.base.flags import ArgumentParser

DEFAULT_CASES = [(9, 128, 128), (17, 128, 128), (49, 128, 128), (9, 256, 256)]
PEAK_CONVS = ["8,256,256,32", "12,128,64,64", "12,64,64,64", "3,512,256,16"]  # N, C_in, C_out, H (= W)
TOLERANCE = 1e-4


# -- profile ----------------------------------------------------------------------------------


def profile_ours(fn: Callable[[], torch.Tensor], top: int = 15) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    averages = prof.key_averages(group_by_input_shape=True)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=top), file=sys.stderr, flush=True)
    total = sum(e.self_cpu_time_total for e in averages) or 1.0
    rows = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [
        {
            "name": e.key,
            "input_shapes": [list(s) if isinstance(s, (list, tuple)) else s for s in e.input_shapes],
            "calls": e.count,
            "self_cpu_ms": e.self_cpu_time_total / 1e3,
            "percent": 100 * e.self_cpu_time_total / total,
        }
        for e in rows
    ]


# -- cases, the run, the report ---------------------------------------------------------------


def parse_size(text: str) -> tuple[int, int]:
    h, w = text.lower().split("x")
    return int(h), int(w)


def parse_case(text: str) -> tuple[int, int, int]:
    t, h, w = text.lower().split("x")
    return int(t), int(h), int(w)


def cases_from(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    if args.cases:
        return [parse_case(c) for c in args.cases]
    if args.frames is None and args.sizes is None:
        return list(DEFAULT_CASES)
    sizes = [parse_size(s) for s in (args.sizes or ["128x128"])]
    return [(t, h, w) for h, w in sizes for t in (args.frames or [9])]


def _case_text(frames: int, height: int, width: int) -> str:
    return f"{frames}x{height}x{width}"


def _log(row: dict) -> None:
    memory = f"  {row['ours_mb']:.0f} MB vs {row['published_mb']:.0f} MB" if "ours_mb" in row else ""
    print(
        f"{row['variant']} {row['op']:6s} {row['mode']:10s} T={row['frames']:3d} {row['height']}x{row['width']}: "
        f"ours {row['ours_s']:.4f}s published {row['published_s']:.4f}s x{row['ratio']:.2f}{memory} "
        f"|diff| {row['max_abs_diff']:.2e}",
        file=sys.stderr,
        flush=True,
    )


def compare(
    ours_fn: Callable[[], torch.Tensor],
    pub_fn: Callable[[], torch.Tensor],
    warmup: int,
    repeats: int,
    label: str,
    decoded: bool,
) -> dict:
    """Alternating timings of ours and the published call, and how far their outputs differ."""
    with torch.inference_mode():
        ours_times, pub_times, ours_out, pub_out = time_alternating(ours_fn, pub_fn, warmup, repeats)
    if ours_out.shape != pub_out.shape:
        sys.exit(
            f"bench_speed: {label}: output shapes differ (ours {tuple(ours_out.shape)}, "
            f"published {tuple(pub_out.shape)})"
        )
    row = {
        "output_shape": list(ours_out.shape),
        "ours_s": statistics.median(ours_times),
        "published_s": statistics.median(pub_times),
        "ours_min_s": min(ours_times),
        "published_min_s": min(pub_times),
        "ours_times": ours_times,
        "published_times": pub_times,
    }
    row["ratio"] = row["published_s"] / row["ours_s"]
    row["ratio_min"] = row["published_min_s"] / row["ours_min_s"]
    row["max_abs_diff"] = (ours_out - pub_out).abs().max().item()
    if decoded:  # how much of the output the [0, 1] clamp leaves to compare
        row["unclamped_fraction"] = ((pub_out > 0) & (pub_out < 1)).float().mean().item()
    return row


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    taehv_module.SEQUENTIAL_CHUNK_BYTES = args.sequential_chunk_bytes
    cases = cases_from(args)
    settings = {
        "variants": args.variants,
        "cases": [_case_text(*c) for c in cases],
        "ops": args.ops,
        "modes": args.modes,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "dtype": "fp32",
        "batch": 1,
        "memory": args.memory,
        "roofline": args.roofline,
        "tolerance": args.tolerance,
        "seed": args.seed,
        "sequential_chunk_bytes": args.sequential_chunk_bytes,
        "published_files": sorted({str(published_file(v)) for v in args.variants}),
    }
    report: dict = {
        "benchmark": "speed",
        "date": utc_now(),
        "machine": machine_info(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "settings": settings,
        "rows": [],
    }
    if args.roofline:
        roof = report["roofline"] = measure_peak(args.peak_convs, args.peak_matmul)
        convs = ", ".join(format(c["gflops"], ".1f") for c in roof["convs"])
        matmul = roof["matmul"]["gflops"] if roof["matmul"] else 0.0
        print(
            f"peak: {roof['peak_gflops']:.1f} GFLOP/s (convs {convs}; matmul {matmul:.1f})", file=sys.stderr, flush=True
        )
    profile_case = args.profile_case
    with tempfile.TemporaryDirectory(prefix="bench_speed_") as tmp:
        workdir = Path(tmp)
        for variant in args.variants:
            ours, published, checkpoint = build_pair(variant, workdir, args.seed)
            for frames, height, width in cases:
                video = torch.rand(1, frames, 3, height, width, generator=torch.Generator().manual_seed(args.seed))
                with torch.inference_mode():
                    latents = published.encode_video(video, parallel=True, show_progress_bar=False)
                inputs = {"encode": video, "decode": latents}
                case = _case_text(frames, height, width)
                for op in args.ops:
                    input_path = workdir / f"{variant}_{case}_{op}.pt"
                    if args.memory:
                        torch.save(inputs[op], input_path)
                    for mode in args.modes:
                        parallel = mode == "parallel"
                        ours_fn = operation(ours, False, op, parallel, inputs[op])
                        pub_fn = operation(published, True, op, parallel, inputs[op])
                        row = {
                            "variant": variant,
                            "op": op,
                            "mode": mode,
                            "frames": frames,
                            "height": height,
                            "width": width,
                            "input_shape": list(inputs[op].shape),
                            **compare(
                                ours_fn,
                                pub_fn,
                                args.warmup,
                                args.repeats,
                                f"{variant} {op} {mode} {case}",
                                decoded=op == "decode",
                            ),
                        }
                        if args.roofline:
                            with torch.inference_mode():
                                row["published_flops"], row["ours_flops"] = count_flops(pub_fn), count_flops(ours_fn)
                            add_roofline(row, report["roofline"]["peak_gflops"])
                        if args.profile and profile_case is None and op == "decode" and parallel:
                            profile_case = f"{op}:{mode}:{case}"
                        if args.profile and profile_case == f"{op}:{mode}:{case}" and "profile" not in report:
                            with torch.inference_mode():
                                top = profile_ours(ours_fn)
                            report["profile"] = {"case": profile_case, "variant": variant, "top_ops": top}
                        if args.memory:
                            common = {
                                "variant": variant,
                                "checkpoint": str(checkpoint),
                                "threads": args.threads,
                                "sequential_chunk_bytes": args.sequential_chunk_bytes,
                                "published_file": str(published_file(variant)),
                                "input": str(input_path),
                                "op": op,
                                "mode": mode,
                            }
                            mem = {impl: measure_memory({**common, "impl": impl}) for impl in ("ours", "published")}
                            row["ours_mb"], row["published_mb"] = mem["ours"]["peak_mb"], mem["published"]["peak_mb"]
                            row["memory_ratio"] = (
                                row["ours_mb"] / row["published_mb"] if row["published_mb"] > 0 else None
                            )
                            row["ours_heap_mb"], row["published_heap_mb"] = (
                                mem["ours"]["heap_mb"],
                                mem["published"]["heap_mb"],
                            )
                            row["heap_ratio"] = (
                                row["ours_heap_mb"] / row["published_heap_mb"]
                                if (row["published_heap_mb"] or 0) > 0 and row["ours_heap_mb"] is not None
                                else None
                            )
                            row["memory"] = mem
                        report["rows"].append(row)
                        _log(row)
    if args.profile and "profile" not in report:
        print(f"bench_speed: --profile_case {profile_case!r} matched no measured case", file=sys.stderr)
    report["max_abs_diff"] = max((r["max_abs_diff"] for r in report["rows"]), default=0.0)
    report["all_within_tolerance"] = report["max_abs_diff"] < args.tolerance
    return report


def _fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _table(header: list[str], rows: list[list[str]], right_from: int) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    return ["| " + " | ".join(cells) + " |" for cells in [header, align, *rows]]


def markdown(report: dict) -> str:
    """The rows as Markdown tables (timings and memory; roofline; profile) for docs/benchmarks.md."""
    machine, rows = report["machine"], report["rows"]
    key = [
        lambda r: r["variant"],
        lambda r: r["op"],
        lambda r: r["mode"],
        lambda r: str(r["frames"]),
        lambda r: f"{r['height']}x{r['width']}",
    ]
    lines = [
        f"TAEHV vs the published implementation, CPU fp32, batch 1, {report['threads']} threads, median of "
        f"{report['settings']['repeats']} alternating runs ({report['date'][:10]}, "
        f"{machine['cpu_model'] or machine['processor']}, {machine['cpu_capability']}, torch {report['torch']}); "
        "ratio = published s / ours s; MB: peak RSS growth of the first call (with what libraries set up once), "
        "heap MB: peak bytes allocated and not freed during a later call; memory ratios: ours / published.",
        "",
    ]
    lines += _table(
        [
            "variant",
            "op",
            "mode",
            "T",
            "size",
            "ours s",
            "published s",
            "ratio",
            "ours MB",
            "published MB",
            "memory ratio",
            "ours heap MB",
            "published heap MB",
            "heap ratio",
            "max abs diff",
        ],
        [
            [k(r) for k in key]
            + [
                f"{r['ours_s']:.3f}",
                f"{r['published_s']:.3f}",
                f"{r['ratio']:.2f}",
                _fmt(r.get("ours_mb"), ".0f"),
                _fmt(r.get("published_mb"), ".0f"),
                _fmt(r.get("memory_ratio"), ".2f"),
                _fmt(r.get("ours_heap_mb"), ".0f"),
                _fmt(r.get("published_heap_mb"), ".0f"),
                _fmt(r.get("heap_ratio"), ".2f"),
                f"{r['max_abs_diff']:.1e}",
            ]
            for r in rows
        ],
        3,
    )
    if "roofline" in report:
        roof = report["roofline"]
        convs = ", ".join(
            f"{c['shape']['n']}x{c['shape']['c_in']}->{c['shape']['c_out']} at "
            f"{c['shape']['h']}x{c['shape']['w']}: {c['gflops']:.1f}"
            for c in roof["convs"]
        )
        matmul = f"; matmul {roof['matmul']['n']}^3: {roof['matmul']['gflops']:.1f}" if roof["matmul"] else ""
        lines += [
            "",
            f"Measured peak: {roof['peak_gflops']:.1f} GFLOP/s (fp32 3x3 convs in channels_last, "
            f"N x C_in->C_out at HxW: {convs}{matmul}). GFLOP/s: the published call's convolution FLOPs "
            "(2 x MACs) per second, for both; max ratio at peak = published s / (our FLOPs / peak).",
            "",
        ]
        lines += _table(
            [
                "variant",
                "op",
                "mode",
                "T",
                "size",
                "published GFLOP",
                "our GFLOP",
                "published GFLOP/s",
                "ours GFLOP/s",
                "published % peak",
                "ours % peak",
                "max ratio at peak",
            ],
            [
                [k(r) for k in key]
                + [
                    f"{r['published_flops']['conv'] / 1e9:.2f}",
                    f"{r['ours_flops']['conv'] / 1e9:.2f}",
                    f"{r['published_gflops_s']:.1f}",
                    f"{r['ours_gflops_s']:.1f}",
                    f"{100 * r['published_peak_fraction']:.0f}%",
                    f"{100 * r['ours_peak_fraction']:.0f}%",
                    f"{r['max_ratio_at_peak']:.2f}",
                ]
                for r in rows
            ],
            3,
        )
    if "profile" in report:
        profile = report["profile"]
        lines += ["", f"Top ops of ours by self CPU time, {profile['variant']} {profile['case']}:", ""]
        lines += _table(
            ["op", "input shapes", "calls", "ms", "%"],
            [
                [
                    e["name"],
                    str([s for s in e["input_shapes"] if s]),
                    str(e["calls"]),
                    f"{e['self_cpu_ms']:.2f}",
                    f"{e['percent']:.1f}",
                ]
                for e in profile["top_ops"]
            ],
            2,
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["taecvx"])
    parser.add_argument("--cases", nargs="+", metavar="TxHxW", help="explicit cases, e.g. 9x128x128 17x256x256")
    parser.add_argument("--frames", type=int, nargs="+", help="with --sizes: their product (default 9)")
    parser.add_argument("--sizes", nargs="+", metavar="HxW", help="with --frames: their product (default 128x128)")
    parser.add_argument("--ops", nargs="+", choices=["encode", "decode"], default=["encode", "decode"])
    parser.add_argument("--modes", nargs="+", choices=["parallel", "sequential"], default=["parallel", "sequential"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--sequential_chunk_bytes",
        type=int,
        default=taehv_module.SEQUENTIAL_CHUNK_BYTES,
        help="ours: models.taehv.SEQUENTIAL_CHUNK_BYTES (0: sequential decoding one latent at a time)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="max |ours - published| allowed")
    parser.add_argument("--no_memory", dest="memory", action="store_false", help="skip the peak-memory processes")
    parser.add_argument("--roofline", dest="roofline", action="store_true", default=True)
    parser.add_argument("--no_roofline", dest="roofline", action="store_false")
    parser.add_argument(
        "--peak_convs",
        nargs="+",
        default=PEAK_CONVS,
        metavar="N,CIN,COUT,H",
        help="3x3 convolutions measuring the peak (H = W)",
    )
    parser.add_argument("--peak_matmul", type=int, default=4096, help="n of the n x n matmul (0: none)")
    parser.add_argument("--profile", action="store_true", help="torch.profiler on ours for --profile_case")
    parser.add_argument("--profile_case", metavar="OP:MODE:TxHxW", help="default: the first decode case, parallel")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table after the JSON")
    parser.add_argument("--out", type=Path, help="also write the JSON here (and the Markdown to its .md)")
    args = parser.parse_args(argv)

    report = run(args)
    print_json(report, indent=2, out=args.out)
    if args.markdown:
        table = markdown(report)
        print("\n" + table, flush=True)
        if args.out:
            args.out.with_suffix(".md").write_text(table)
    if not report["all_within_tolerance"]:
        bad = [
            f"{r['variant']} {r['op']} {r['mode']} {_case_text(r['frames'], r['height'], r['width'])}: "
            f"{r['max_abs_diff']:.2e}"
            for r in report["rows"]
            if not r["max_abs_diff"] < args.tolerance
        ]
        print(
            f"bench_speed: ours and the published outputs differ by more than {args.tolerance:g} in "
            f"{len(bad)} case(s): " + "; ".join(bad),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
