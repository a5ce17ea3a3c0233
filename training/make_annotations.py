"""Write train/val annotation files for a folder of videos.

    python -m training.make_annotations DIR -o annotations.json [--val_fraction 0.1]

Every video under DIR is decoded once to learn how many frames really decode (container
counts can be wrong), its fps and size. Unusable files are left out and reported with
the reason. Kept clips are split into ``<out>_train.json`` and ``<out>_val.json`` in the
users' format ``{"total": N, "list": [{"path", "full_path", "frames", "duration", ...}]}``;
the skipped files and reasons go to ``<out>_skipped.json``.

Clips from the same source stay on the same side of the split: the group of a clip is
the first match of ``--group_regex`` on its path relative to DIR (by default its folder
plus the file name up to the first "_" or "."), and the split is deterministic given
``--seed``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from multiprocessing import Pool
from pathlib import Path

from tqdm import tqdm

from common.clips import BadClipError, find_videos, probe_video
from common.flags import ArgumentParser

DEFAULT_GROUP_REGEX = r"^(?:.*/)?[^_./]+"


def group_key(rel_path: str, pattern: re.Pattern[str] | None) -> str:
    """The source a clip comes from; the whole path when there is no pattern or match."""
    match = pattern.search(rel_path) if pattern is not None else None
    return match.group(0) if match else rel_path


def split_train_val(keys: Sequence[str], val_fraction: float, seed: int) -> list[bool]:
    """``is_val`` per item: whole groups, in a seeded hash order, go to validation while
    that brings the validation size closer to ``val_fraction`` of all items."""
    sizes = Counter(keys)
    order = sorted(sizes, key=lambda k: hashlib.sha256(f"{seed}:{k}".encode()).hexdigest())
    target = val_fraction * len(keys)
    val_groups, val_size = set(), 0
    for key in order:
        if abs(val_size + sizes[key] - target) < abs(val_size - target):
            val_groups.add(key)
            val_size += sizes[key]
    return [k in val_groups for k in keys]


def write_annotation(path: Path, entries: Sequence[dict]) -> None:
    """Users' format, one clip per line so that large files stay diffable."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(f'{{"total": {len(entries)}, "list": [\n')
        f.write(",\n".join(json.dumps(e, ensure_ascii=False) for e in entries))
        f.write("\n]}\n")


def _probe(args: tuple[Path, str, int]) -> tuple[str, dict | None, str | None]:
    root, rel, min_frames = args
    full = (root / rel).resolve()
    try:
        info = probe_video(full)
    except BadClipError as err:
        return rel, None, str(err)
    if info.frames < min_frames:
        return rel, None, f"too short: {info.frames} decodable frames < --min_frames {min_frames}"
    entry = {
        "path": rel,
        "full_path": str(full),
        "frames": info.frames,
        "duration": round(info.frames / info.fps, 3) if info.fps > 0 else None,
        "fps": round(info.fps, 3),
        "width": info.width,
        "height": info.height,
    }
    return rel, entry, None


def probe_all(root: Path, rel_paths: Sequence[str], min_frames: int, workers: int) -> Iterable[tuple]:
    jobs = [(root, rel, min_frames) for rel in rel_paths]
    if workers <= 1:
        yield from map(_probe, jobs)
        return
    with Pool(workers) as pool:
        yield from pool.imap(_probe, jobs, chunksize=4)


def output_paths(out: Path) -> dict[str, Path]:
    return {part: out.with_name(f"{out.stem}_{part}{out.suffix or '.json'}") for part in ("train", "val", "skipped")}


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help="folder scanned recursively for videos")
    parser.add_argument("-o", "--output", type=Path, required=True, help="e.g. annotations.json")
    parser.add_argument("--val_fraction", type=float, default=0.1, help="share of clips for validation")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    parser.add_argument(
        "--group_regex",
        default=DEFAULT_GROUP_REGEX,
        help="first match on the relative path = source group kept on one side ('' = no grouping)",
    )
    parser.add_argument("--min_frames", type=int, default=1, help="skip clips with fewer decodable frames")
    parser.add_argument("--workers", type=int, default=1, help="probing processes")
    args = parser.parse_args(argv)

    if not args.directory.is_dir():
        parser.error(f"{args.directory} is not a folder")
    if not 0 <= args.val_fraction < 1:
        parser.error("--val_fraction must be in [0, 1)")
    root = args.directory.resolve()
    rel_paths = find_videos(root)
    kept, skipped = [], []
    probes = probe_all(root, rel_paths, args.min_frames, args.workers)
    for rel, entry, reason in tqdm(probes, total=len(rel_paths), desc="probing videos", unit="video"):
        if entry is None:
            skipped.append({"path": rel, "reason": reason})
        else:
            kept.append(entry)

    pattern = re.compile(args.group_regex) if args.group_regex else None
    is_val = split_train_val([group_key(e["path"], pattern) for e in kept], args.val_fraction, args.seed)
    train = [e for e, v in zip(kept, is_val) if not v]
    val = [e for e, v in zip(kept, is_val) if v]

    paths = output_paths(args.output)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_annotation(paths["train"], train)
    write_annotation(paths["val"], val)
    paths["skipped"].write_text(json.dumps({"total": len(skipped), "list": skipped}, indent=1) + "\n")

    print(f"found {len(rel_paths)} videos under {root}: kept {len(kept)}, skipped {len(skipped)}")
    print(f"train: {len(train)} clips -> {paths['train']}")
    print(f"val:   {len(val)} clips -> {paths['val']}")
    if not val and args.val_fraction > 0 and kept:
        print("note: no source group is small enough for --val_fraction; the validation file is empty")
    if skipped:
        reasons = Counter(s["reason"].split(":")[0] for s in skipped)
        print(f"skipped ({dict(reasons)}) -> {paths['skipped']}")
        for s in skipped[:20]:
            print(f"  {s['path']}: {s['reason']}")
        if len(skipped) > 20:
            print(f"  ... and {len(skipped) - 20} more")
    if not kept:
        print("no usable videos: nothing to train on")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
