"""The roofline of a CPU call: this CPU's measured fp32 peak (large 3x3 convolutions in
channels_last and a large matmul) and the convolution FLOPs a call does
(``torch.utils.flop_counter.FlopCounterMode``'s rule, 2 x MACs, with oneDNN's fused
convolutions counted by the same rule); bench/bench_speed.py's ``--roofline``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.lib.harness import best_seconds


def _fused_conv_flop(*args, out_shape=None, **kwargs) -> int:
    """``mkldnn._convolution_pointwise`` (X, W, B, ...) and its ``.binary`` overload
    (X, other, W, B, ...): 2 x MACs, FlopCounterMode's convolution rule."""
    from torch.utils.flop_counter import conv_flop_count

    x_shape, w_shape = args[0], args[2] if len(args) > 10 else args[1]
    return conv_flop_count(list(x_shape), list(w_shape), list(out_shape))


def count_flops(fn: Callable[[], torch.Tensor]) -> dict[str, int]:
    """Convolution FLOPs and all FLOPs FlopCounterMode sees in one call of ``fn``."""
    from torch.utils.flop_counter import FlopCounterMode

    mapping = {}
    if hasattr(torch.ops.mkldnn, "_convolution_pointwise"):
        mapping[torch.ops.mkldnn._convolution_pointwise] = _fused_conv_flop
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        fn()
    counts = counter.get_flop_counts().get("Global", {})
    conv = sum(v for k, v in counts.items() if "convolution" in str(k))
    return {"conv": int(conv), "total": int(sum(counts.values()))}


def measure_peak(conv_shapes: list[str], matmul_n: int, repeats: int = 3) -> dict:
    """GFLOP/s of large fp32 3x3 convolutions (channels_last) and of an n x n matmul on this
    CPU at the current thread count; ``peak_gflops`` is the best of them."""
    convs = []
    with torch.inference_mode():
        for shape in conv_shapes:
            n, c_in, c_out, hw = (int(v) for v in shape.split(","))
            x = torch.randn(n, c_in, hw, hw).contiguous(memory_format=torch.channels_last)
            w = torch.randn(c_out, c_in, 3, 3).contiguous(memory_format=torch.channels_last)
            flops = 2 * n * c_out * c_in * 9 * hw * hw
            seconds = best_seconds(lambda: F.conv2d(x, w, padding=1), repeats)  # noqa: B023
            convs.append(
                {
                    "shape": {"n": n, "c_in": c_in, "c_out": c_out, "h": hw, "w": hw},
                    "gflop": flops / 1e9,
                    "seconds": seconds,
                    "gflops": flops / seconds / 1e9,
                }
            )
        matmul = None
        if matmul_n:
            a, b = torch.randn(matmul_n, matmul_n), torch.randn(matmul_n, matmul_n)
            seconds = best_seconds(lambda: a @ b, repeats)
            matmul = {"n": matmul_n, "seconds": seconds, "gflops": 2 * matmul_n**3 / seconds / 1e9}
    conv_peak = max((c["gflops"] for c in convs), default=0.0)
    return {
        "convs": convs,
        "conv_peak_gflops": conv_peak,
        "matmul": matmul,
        "peak_gflops": max(conv_peak, matmul["gflops"] if matmul else 0.0),
    }


def add_roofline(row: dict, peak_gflops: float) -> None:
    pub_flops, our_flops = row["published_flops"]["conv"], row["ours_flops"]["conv"]
    peak = peak_gflops * 1e9
    row["published_gflops_s"] = pub_flops / row["published_s"] / 1e9
    row["ours_gflops_s"] = pub_flops / row["ours_s"] / 1e9  # on the published FLOPs: work done per second
    row["ours_actual_gflops_s"] = our_flops / row["ours_s"] / 1e9
    row["published_peak_fraction"] = row["published_gflops_s"] * 1e9 / peak
    row["ours_peak_fraction"] = row["ours_gflops_s"] * 1e9 / peak
    row["ours_actual_peak_fraction"] = row["ours_actual_gflops_s"] * 1e9 / peak
    row["ratio_at_peak_same_flops"] = row["published_s"] * peak / pub_flops
    row["max_ratio_at_peak"] = row["published_s"] / (our_flops / peak)
