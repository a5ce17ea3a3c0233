#!/usr/bin/env python3
"""The pre-flight's activation estimate (``training/loop/memory.py``) against the real peak
of one training forward and backward pass; prints JSON.

    OMP_NUM_THREADS=2 python -m bench.bench_step_memory --cases taehv:1:9:128:128 taeh3:1:22:256:256

Each case (variant:batch:frames:height:width, fp32, no reference latents) runs in a fresh
process: on CUDA the peak is ``torch.cuda.max_memory_allocated`` over the weights
already there; on the CPU it is the growth of the maximum RSS. ``ratio`` is peak over
estimate: the estimate counts what the forward keeps for the backward pass, the peak adds
the backward's gradient buffers.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

from taehv_train.base.flags import ArgumentParser

MEASURE = """
import json, resource, sys, torch
from taehv_train.models.taehv import TAEHV
from taehv_train.training.loop.memory import activation_bytes
variant, batch, frames, height, width = sys.argv[1], *map(int, sys.argv[2:6])
device = "cuda" if torch.cuda.is_available() else "cpu"
net = TAEHV(variant=variant).to(device)
clips = torch.rand(batch, frames, 3, height, width, device=device)

def peak():
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

before = torch.cuda.memory_allocated() if device == "cuda" else peak()
net(clips, None, decode_own=True).decoded.float().mean().backward()
estimate = activation_bytes(variant, batch, frames, height, width, torch.float32, False, True, True)
print(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  "estimate_mib": round(estimate / 2**20, 1), "peak_mib": round((peak() - before) / 2**20, 1),
                  "ratio": round((peak() - before) / estimate, 3)}))
"""


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["taehv:1:9:128:128", "taehv:1:17:256:256", "taew2_2:1:17:256:256", "taeh3:1:22:256:256"],
    )
    args = parser.parse_args()
    results = []
    for case in args.cases:
        variant, *sizes = case.split(":")
        out = subprocess.run(
            [sys.executable, "-c", MEASURE, variant, *sizes], capture_output=True, text=True, check=True
        )
        results.append({"case": case, **json.loads(out.stdout)})
    print(json.dumps({"benchmark": "step_memory", "python": platform.python_version(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
