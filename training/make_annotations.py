"""Write train/val annotation files for a folder of videos (or of still images).

    python -m training.make_annotations DIR -o annotations.json [--val_fraction 0.1]

Every video under DIR is decoded once to learn how many frames really decode (container
counts can be wrong), its fps and size. With ``--images`` still images (.png, .webp: the
RGBA data) are annotated too, as one-frame clips with their size; a folder with images and
no videos gets them without the flag (a note says so). Unusable files are left out and
reported with the reason: unreadable, no decodable frames, too short for ``--min_frames``,
not a regular file (a FIFO, socket or device is never opened: reading one can block
forever), or a probe still running after ``--probe_timeout`` seconds (its worker process is
killed and replaced; a worker that crashes on a file is replaced too). Kept clips are split
into ``<out>_train.json`` and ``<out>_val.json`` in the users' format
``{"total": N, "list": [{"path", "full_path", "frames", "duration", ...}]}``, sorted by path;
the skipped files and reasons go to ``<out>_skipped.json``. Existing output files are
replaced only with ``--force``.

Clips from the same source stay on the same side of the split: the group of a clip is
the first match of ``--group_regex`` on its path relative to DIR (by default its folder
plus the file name up to the first "_" or "."), and the split is deterministic given
``--seed``. When the grouping leaves the validation (or training) file empty, a warning
names the groups and gives the command that splits file by file.

Exit status: 0 when the files are usable for training (clips in the train file, and in the
validation file unless ``--val_fraction 0``); 1 when they were written but are not (no
usable clip, or one side of the split is empty; the output says why and what to run);
2 for a user's mistake, found before anything is probed (a flag out of range, DIR not a
folder, existing output files without ``--force``) or when writing fails (no space, no
permission): ``error: ...`` on stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import re
import shlex
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path

from tqdm import tqdm

from common.clips import IMAGE_EXTENSIONS, BadClipError, check_regular_file, find_videos, probe_video
from common.errors import UserError, exit_on_user_error
from common.flags import ArgumentParser

DEFAULT_GROUP_REGEX = r"^(?:.*/)?[^_./]+"
DEFAULT_PROBE_TIMEOUT = 600.0  # seconds per file: 1.5-5 hours of 720p at 30 fps at 300-900 frames/s

Job = tuple[Path, str, int]  # (root, path relative to it, min_frames)
Result = tuple[str, dict | None, str | None]  # (relative path, annotation entry or None, why it was skipped)


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


def _probe(job: Job) -> Result:
    root, rel, min_frames = job
    full = (root / rel).resolve()
    try:
        info = probe_video(full)
    except BadClipError as err:
        return rel, None, str(err)
    if info.frames < min_frames:
        return rel, None, f"too short: {info.frames} decodable frames < --min_frames {min_frames}"
    entry: dict = {"path": rel, "full_path": str(full), "frames": info.frames}
    if full.suffix.lower() not in IMAGE_EXTENSIONS:  # a still image has no duration or fps
        entry["duration"] = round(info.frames / info.fps, 3) if info.fps > 0 else None
        entry["fps"] = round(info.fps, 3)
    entry["width"], entry["height"] = info.width, info.height
    return rel, entry, None


def _probe_worker(conn: Connection) -> None:
    """A probing process: probes the jobs it receives, one at a time, until it gets None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the parent's: it ends the workers
    while (job := conn.recv()) is not None:
        conn.send(_probe(job))


class _Worker:
    """One probing process and the job it has in flight (with its start time)."""

    def __init__(self, context: multiprocessing.context.BaseContext):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_probe_worker, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self.rel: str | None = None
        self.started = 0.0

    def start(self, job: Job) -> None:
        self.rel, self.started = job[1], time.monotonic()
        self.conn.send(job)

    def died(self) -> str:
        """The skip reason of the job in flight when the process ended by itself."""
        self.process.join()
        code = self.process.exitcode
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}"
        return f"probe process died ({how})"

    def kill(self) -> None:
        """SIGKILL: a read stuck in the kernel or a decoder loop cannot be interrupted otherwise."""
        self.process.kill()
        self.process.join(timeout=10)
        self.conn.close()

    def stop(self) -> None:
        self.conn.send(None)
        self.process.join(timeout=10)
        self.conn.close()


def probe_all(root: Path, rel_paths: Sequence[str], min_frames: int, workers: int, timeout: float) -> Iterator[Result]:
    """Probe ``rel_paths`` and yield ``(rel, entry, reason)`` per file, in completion order.

    A file that is not a regular file is reported without being opened. The others are
    probed in up to ``workers`` worker processes, one file in flight per worker: a probe
    still running after ``timeout`` seconds has its worker killed and replaced, and a
    worker that dies on a file is replaced; either way the file is reported with the
    reason and probing carries on."""
    pending: deque[Job] = deque()
    for rel in rel_paths:
        try:
            check_regular_file(root / rel)  # from stat alone: opening a FIFO can wait forever
        except BadClipError as err:
            yield rel, None, str(err)
            continue
        pending.append((root, rel, min_frames))
    if not pending:
        return
    # fork: a worker starts at once (no re-import of torch and OpenCV), also as a replacement
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    pool: list[_Worker] = []
    try:
        for _ in range(min(workers, len(pending))):
            pool.append(_Worker(context))
            pool[-1].start(pending.popleft())
        while busy := [w for w in pool if w.rel is not None]:
            first_deadline = min(w.started for w in busy) + timeout
            ready = wait([w.conn for w in busy], timeout=max(0.0, first_deadline - time.monotonic()))
            for worker in busy:
                if worker.conn in ready:
                    try:
                        result = worker.conn.recv()
                    except EOFError:  # the process ended without an answer (a decoder crash)
                        result = (worker.rel, None, worker.died())
                elif time.monotonic() - worker.started >= timeout:
                    result = (worker.rel, None, f"timed out after {timeout:g} s")
                    worker.kill()
                else:
                    continue
                yield result
                worker.rel = None
                if not worker.process.is_alive():
                    pool[pool.index(worker)] = worker = _Worker(context)
                if pending:
                    worker.start(pending.popleft())
        for worker in pool:
            worker.stop()
    finally:
        for worker in pool:
            if worker.process.is_alive():
                worker.kill()


def output_paths(out: Path) -> dict[str, Path]:
    return {part: out.with_name(f"{out.stem}_{part}{out.suffix or '.json'}") for part in ("train", "val", "skipped")}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def split_problem(
    paths: Sequence[str], pattern: re.Pattern[str] | None, val_fraction: float, seed: int
) -> tuple[str, list[str]] | None:
    """Why the split of ``paths`` leaves the validation or the training side empty while
    ``val_fraction`` > 0, and the flags that give both sides clips ([] when none can: a
    single clip); None when the split is usable."""
    keys = [group_key(p, pattern) for p in paths]
    n_val = sum(split_train_val(keys, val_fraction, seed))
    if val_fraction == 0 or 0 < n_val < len(paths):
        return None
    side = "validation" if n_val == 0 else "training"
    if len(paths) == 1:
        return f"the {side} file is empty: a single clip cannot be split", []
    groups = Counter(keys)
    if len(groups) == 1:
        why = f"all {len(paths)} clips are in one group, {keys[0]!r}"
    elif n_val:
        why = f"--val_fraction {val_fraction:g} puts all {len(groups)} groups of the {len(paths)} clips in validation"
    else:
        smallest = min(groups, key=lambda k: (groups[k], k))
        why = (
            f"the smallest of the {len(groups)} groups, {smallest!r}, has {groups[smallest]} of the {len(paths)} "
            f"clips, more than the ~{val_fraction * len(paths):.1f} that --val_fraction {val_fraction:g} asks for"
        )
    message = f"the {side} file is empty: {why}, and each group stays on one side of the split"
    fraction = 0.1 if n_val else max(val_fraction, math.ceil(100 / len(paths)) / 100)
    for flags, new_pattern, new_fraction in (
        (["--group_regex", ""], None, val_fraction),
        (["--val_fraction", f"{fraction:g}"], pattern, fraction),
        (["--group_regex", "", "--val_fraction", f"{fraction:g}"], None, fraction),
    ):
        keys = [group_key(p, new_pattern) for p in paths]
        if new_fraction < 1 and 0 < sum(split_train_val(keys, new_fraction, seed)) < len(paths):
            return message, flags
    return message, []


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
    parser.add_argument(
        "--min_frames", type=positive_int, default=1, help="skip clips with fewer decodable frames (default: 1)"
    )
    parser.add_argument("--workers", type=positive_int, default=1, help="probing processes (default: 1)")
    parser.add_argument(
        "--probe_timeout",
        type=positive_seconds,
        default=DEFAULT_PROBE_TIMEOUT,
        help="seconds one file may take to probe; its worker is then killed and the file skipped "
        "(default: %(default)g; raise it for videos of hours)",
    )
    parser.add_argument(
        "--images",
        action="store_true",
        help=f"annotate still images ({' '.join(IMAGE_EXTENSIONS)}) too, as one-frame clips "
        "(automatic when DIR holds no videos)",
    )
    parser.add_argument("--force", action="store_true", help="replace the annotation files when they exist")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)

    if not args.directory.is_dir():
        parser.error(f"{args.directory} is not a folder")
    if not 0 <= args.val_fraction < 1:
        parser.error("--val_fraction must be in [0, 1)")
    try:
        pattern = re.compile(args.group_regex) if args.group_regex else None
    except re.error as err:
        parser.error(f"--group_regex {args.group_regex!r} is not a regular expression: {err}")
    if args.output.is_dir():
        raise UserError(f"-o {args.output} is a folder: name a file, e.g. {args.output / 'annotations.json'}")
    paths = output_paths(args.output)
    if not args.force and (there := [p.name for p in paths.values() if p.exists()]):
        raise UserError(
            f"{args.output.parent} already holds {', '.join(there)}: pass --force to replace them, or another -o"
        )

    root = args.directory.resolve()
    images = args.images
    rel_paths = find_videos(root, images)
    if not rel_paths and not images and (rel_paths := find_videos(root, images=True)):
        images = True
        print(f"note: no videos under {root}: annotating its {len(rel_paths)} still images (one frame each)")
    what = "videos and images" if images else "videos"
    kept, skipped = [], []
    probes = probe_all(root, rel_paths, args.min_frames, args.workers, args.probe_timeout)
    for rel, entry, reason in tqdm(probes, total=len(rel_paths), desc=f"probing {what}", unit="file"):
        if entry is None:
            skipped.append({"path": rel, "reason": reason})
        else:
            kept.append(entry)
    kept.sort(key=lambda e: e["path"])  # workers finish in any order; the files do not depend on it
    skipped.sort(key=lambda s: s["path"])

    is_val = split_train_val([group_key(e["path"], pattern) for e in kept], args.val_fraction, args.seed)
    train = [e for e, v in zip(kept, is_val) if not v]
    val = [e for e, v in zip(kept, is_val) if v]

    try:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        write_annotation(paths["train"], train)
        write_annotation(paths["val"], val)
        paths["skipped"].write_text(json.dumps({"total": len(skipped), "list": skipped}, indent=1) + "\n")
    except OSError as err:  # read-only file system, no space, no permission: the user's to fix
        raise UserError(f"cannot write the annotations next to {args.output}: {err.strerror or err}") from None

    print(f"found {len(rel_paths)} {what} under {root}: kept {len(kept)}, skipped {len(skipped)}")
    print(f"train: {len(train)} clips -> {paths['train']}")
    print(f"val:   {len(val)} clips -> {paths['val']}")
    if skipped:
        reasons = Counter(s["reason"].split(":")[0] for s in skipped)
        print(f"skipped ({dict(reasons)}) -> {paths['skipped']}")
        for s in skipped[:20]:
            print(f"  {s['path']}: {s['reason']}")
        if len(skipped) > 20:
            print(f"  ... and {len(skipped) - 20} more")
    if not kept:
        print(f"no usable {what}: nothing to train on")
        return 1
    problem = split_problem([e["path"] for e in kept], pattern, args.val_fraction, args.seed)
    if problem is not None:
        message, flags = problem
        again = ["python", "-m", "training.make_annotations", *argv, *flags, *([] if args.force else ["--force"])]
        fix = (
            f"to fix it, run: {shlex.join(again)}"
            if flags
            else "add clips, or pass --val_fraction 0 and train without validation (no val_annotation_file)"
        )
        print(f"warning: {message}; {fix}", file=sys.stderr)
        return 1
    return 0


def _exit_with_status(argv: Sequence[str] | None = None) -> None:
    sys.exit(main(argv))


if __name__ == "__main__":
    exit_on_user_error(_exit_with_status)
