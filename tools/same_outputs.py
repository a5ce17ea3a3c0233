#!/usr/bin/env python3
"""Do two checkouts produce the same outputs? For restructurings that must not change behaviour.

    python -m tools.same_outputs run /tmp/before --inputs /tmp/same_inputs   # in the old checkout
    python -m tools.same_outputs run /tmp/after --inputs /tmp/same_inputs    # in the new one
    python -m tools.same_outputs compare /tmp/before /tmp/after

``run`` trains the test preset for 4 steps in four set-ups (1 process without and with a
reference VAE; 2-process DeepSpeed ZeRO-2 without, and in bf16 with a reference VAE),
builds a latent cache and runs ``inference.py --use_ref_vae`` on the second run's model.
``--inputs`` holds the clips and a tiny CogVideoX VAE, made on first use and shared by both
runs (libx264 does not write the clips byte for byte the same twice). ``compare`` prints
JSON: per run folder, how many files are the same by what they hold (tensors and metadata
of safetensors; JSON with the run folder and wall-clock timings masked; decoded pixels of
PNG and MP4) and which differ. Expected differences: the training command (command.txt,
the model card), the HTML report (it shows timings) and the ``*_original.mp4`` videos
(libx264 encodes the same frames differently from run to run; the comparison videos show
the same frames). safetensors writes its metadata in no fixed order, so a checkpoint
manifest's checksums are not compared (its file list is, and every file is compared itself).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import torch
from safetensors import safe_open

from bench.lib.harness import REPO_ROOT
from taehv_train.base.flags import ArgumentParser

TEST_CONFIG = "training/configs/taehv_config_test.py"
ZERO2 = [
    str(Path(sys.executable).with_name("accelerate")),
    "launch",
    "--use_deepspeed",
    "--zero_stage",
    "2",
    "--num_machines",
    "1",
    "--num_processes",
    "2",
    "--main_process_port",
    "29611",
]
TIMING = re.compile(r"(_s|seconds|speedup|time|timestamp|clips_per_s)$")


def make_inputs(inputs: Path) -> tuple[Path, Path]:
    """(clips, reference VAE folder), made once."""
    from diffusers import AutoencoderKLCogVideoX

    from taehv_train.training.demo_data import make_demo_dataset

    data, vae = inputs / "data", inputs / "vae"
    if not (data / "annotations_train.json").is_file():
        make_demo_dataset(data, num_clips=6, n_frames=12, height=48, width=64, seed=1)
    if not (vae / "vae" / "config.json").is_file():
        torch.manual_seed(0)
        AutoencoderKLCogVideoX(
            block_out_channels=(16, 16, 32, 32),
            latent_channels=16,
            layers_per_block=1,
            norm_num_groups=8,
            down_block_types=("CogVideoXDownBlock3D",) * 4,
            up_block_types=("CogVideoXUpBlock3D",) * 4,
        ).save_pretrained(vae / "vae")
    return data, vae


def run(out: Path, inputs: Path) -> None:
    data, vae = make_inputs(inputs)
    clips = [
        f"--data_root={data}",
        f"--annotation_file={data / 'annotations_train.json'}",
        f"--val_annotation_file={data / 'annotations_val.json'}",
    ]
    common = ["--config", TEST_CONFIG, *clips, "--run_name=run", "--max_train_steps=4", "--seed=7"]
    ref = [f"--ref_vae_path={vae}", "--ref_vae_dtype=fp32", "--n_frames=9", "--variant=taecvx"]
    train = ["-m", "taehv_train.training.taehv_train", *common]
    commands = {
        "p1": [sys.executable, *train],
        "p1ref": [sys.executable, *train, *ref],
        "z2": [*ZERO2, *train],
        "z2ref": [*ZERO2, *train, *ref, "--mixed_precision=bf16"],
        "cache": [
            sys.executable,
            "-m",
            "taehv_train.training.build_latent_cache",
            "--config",
            TEST_CONFIG,
            *clips,
            *ref,
            "--output",
            str(out / "cache"),
            "--shard_size=4",
        ],
        "infer": [
            sys.executable,
            "inference.py",
            "--model_path",
            str(out / "p1ref" / "run" / "final_model.safetensors"),
            "--variant",
            "taecvx",
            "--videos",
            str(data),
            "--num_samples",
            "3",
            "--n_frames",
            "9",
            "--height",
            "48",
            "--width",
            "64",
            "--use_ref_vae",
            "--ref_vae_path",
            str(vae),
            "--output_dir",
            str(out / "infer"),
        ],
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, command in commands.items():
        if name.startswith(("p1", "z2")):
            command = [*command, f"--output_dir={out / name}"]
        with open(out / f"{name}.log", "w") as log:
            if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT).returncode:
                raise SystemExit(f"{name} failed: see {out / f'{name}.log'}")
        print(f"{name}: done", file=sys.stderr)


def _masked(value, root: Path):
    """JSON with wall-clock timings and the run folder masked, and a checkpoint manifest's
    file list by name only (its sizes and CRC32s follow the run folder's name and the
    metadata order of safetensors files; the files themselves are compared one by one)."""
    if isinstance(value, dict):
        return {
            k: "<time>" if TIMING.search(k) else sorted(v) if k == "files" and isinstance(v, dict) else _masked(v, root)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_masked(v, root) for v in value]
    return value.replace(str(root), "<run>") if isinstance(value, str) else value


def _frames(path: Path) -> list[np.ndarray]:
    capture, frames = cv2.VideoCapture(str(path)), []
    while (read := capture.read())[0]:
        frames.append(read[1])
    return frames


def same(a: Path, root_a: Path, b: Path, root_b: Path) -> tuple[bool, str]:
    """Whether two files hold the same, and by what it was judged."""
    if a.suffix == ".safetensors":
        fa, fb = safe_open(str(a), "pt"), safe_open(str(b), "pt")
        return (
            fa.metadata() == fb.metadata()
            and sorted(fa.keys()) == sorted(fb.keys())
            and all(torch.equal(fa.get_tensor(k), fb.get_tensor(k)) for k in fa.keys())
        ), "tensors and metadata"
    if a.suffix == ".json":
        return _masked(json.loads(a.read_text()), root_a) == _masked(json.loads(b.read_text()), root_b), "json"
    if a.suffix == ".png":
        return np.array_equal(
            cv2.imread(str(a), cv2.IMREAD_UNCHANGED), cv2.imread(str(b), cv2.IMREAD_UNCHANGED)
        ), "pixels"
    if a.suffix == ".mp4":
        fa, fb = _frames(a), _frames(b)
        return len(fa) == len(fb) and all(np.array_equal(x, y) for x, y in zip(fa, fb)), "decoded frames"
    return a.read_bytes().replace(bytes(root_a), b"") == b.read_bytes().replace(bytes(root_b), b""), "bytes"


def compare(root_a: Path, root_b: Path) -> dict:
    report: dict[str, dict] = {}
    for a in sorted(p for p in root_a.rglob("*") if p.is_file() and p.suffix != ".log" and "logs" not in p.parts):
        rel = a.relative_to(root_a)
        b = root_b / rel
        entry = report.setdefault(rel.parts[0], {"same": {}, "different": []})
        if not b.is_file():
            entry["different"].append(f"{rel} (missing)")
            continue
        equal, judged_by = same(a, root_a, b, root_b)
        if equal:
            entry["same"][judged_by] = entry["same"].get(judged_by, 0) + 1
        else:
            entry["different"].append(f"{rel} ({judged_by})")
    return report


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="the runs, into OUT")
    run_parser.add_argument("out", type=Path)
    run_parser.add_argument("--inputs", type=Path, required=True, help="clips and reference VAE, shared by both runs")
    compare_parser = sub.add_parser("compare", help="JSON: what is the same in two OUT folders")
    compare_parser.add_argument("before", type=Path)
    compare_parser.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run(args.out.resolve(), args.inputs.resolve())
    else:
        print(json.dumps(compare(args.before.resolve(), args.after.resolve()), indent=1))


if __name__ == "__main__":
    main()
