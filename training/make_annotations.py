"""Write train/val annotation files for a folder of videos (or of still images).

    python -m taehv_train.training.make_annotations DIR -o annotations.json [--val_fraction 0.1]
    python -m taehv_train.training.make_annotations DIR --to_shards OUT [--shard_size 1GB]

writes annotations_train.json, annotations_val.json and annotations_skipped.json (and the
probe records annotations_probes.jsonl) next to ``-o``, says so with the clip counts, and
prints the launch command that trains on them.

Every video under DIR is probed once for how many frames really decode (container counts
can be wrong), its fps and size: an intact H.264/HEVC file from its packets, anything else
by decoding it (``common.video.probe.probe_video``). With ``--images`` still images (.png, .webp: the
RGBA data) are annotated too, as one-frame clips with their size; a folder with images and
no videos gets them without the flag (a note says so). Unusable files are left out and
reported with the reason: unreadable, no decodable frames, too short for ``--min_frames``,
not a regular file (a FIFO, socket or device is never opened: reading one can block
forever), or a probe still running after ``--probe_timeout`` seconds (its worker process is
killed and replaced; a worker that crashes on a file is replaced too). Kept clips are split
into ``<out>_train.json`` and ``<out>_val.json`` in the users' format
``{"total": N, "list": [{"path", "full_path", "frames", "duration", ...}]}``, sorted by path;
the skipped files and reasons go to ``<out>_skipped.json``.

Incremental: each probe result is appended, as it arrives, to ``<out>_probes.jsonl`` (one
JSON line per file, with its size, mtime_ns and mode). A re-run reuses the
records of files whose path and those are unchanged (a chmod that makes a file readable
changes its mode), drops those of files that are gone, and probes only the rest, so a
grown folder costs only its new files and a stopped run (Ctrl+C, kill -9, a preempted
machine) continues where it stopped. A line that is no valid record (torn by a kill,
damaged, or a result such as ``"frames": -7``) is ignored, with a warning unless it is a
torn last line: only its file is probed again. Files that timed out or crashed their
worker are probed again (that can be transient).
``--min_frames`` and the split are applied when the files are written, so changing them
probes nothing. Existing train/val/skipped files are replaced when a records file next to
them (of a plain run or a shard) is of the same DIR: a re-run updates them. Otherwise they
are replaced only with ``--force``, which also starts over a records file of another DIR.
Delete the records file to probe everything again.

Many machines: ``--shard K/N`` probes the files whose path hashes (sha256) to K of N and
writes only ``<out>_probes.shard-K-of-N.jsonl`` (incremental too); once all N are done,
``--merge`` takes the N parts as the records of a plain run: it probes only the files that
are new or changed since their shard ran (not those that timed out: their shard retries
them), writes ``<out>_probes.jsonl`` and the same train/val/skipped files, byte for byte,
as one machine would on the folder as it is.

Shards: ``--to_shards OUT`` also packs the kept clips into tar shards in the WebDataset
layout (per clip its file as it is and its probe as JSON) under ``OUT/train/`` and
``OUT/val/`` by the split below, at most ``--shard_size`` bytes each (``1GB``, ``500MB``,
``1GiB`` or bytes), each beside its index ``<shard>.index.json``, written once the shard is
complete (``common.shard_writer``); ``OUT`` is a folder or an fsspec URL (``s3://...``).
``-o`` defaults to ``OUT/annotations.json`` (a URL ``OUT`` needs a local ``-o``). A re-run
packs only the clips in no finished shard, into new shards, and packs again those of an
unfinished one (no index). With ``--shard K/N`` a machine annotates and packs the files of
its part, chosen by their source group, on its own (no ``--merge``), as
``part-K-of-N-00000.tar``, ... and ``-o``'s name with ``_part-K-of-N``. It ends with the
command that trains on ``OUT/train/*.tar`` and ``OUT/val/*.tar``.

Run it from the repository root (``python -m`` finds the ``training`` package there), or
from anywhere with the repository on ``PYTHONPATH``.

Clips from the same source stay on the same side of the split: the group of a clip is
the first match of ``--group_regex`` on its path relative to DIR (by default its folder
plus the file name up to the first "_" or "."), and the split is deterministic given
``--seed``. When the grouping leaves the validation (or training) file empty, a warning
names the groups and gives the command that splits file by file. Both files record the
split's settings (a top-level ``"split"`` key; readers take only ``"list"``). A re-run over
them keeps each known clip's side (a new clip of a known group joins its side; only new
groups are split), so runs that use the files never see a held-out clip in training; a
re-run with other ``--val_fraction``, ``--seed`` or ``--group_regex`` is refused while the
files hold clips out, unless ``--resplit``.

Exit status: 0 when the files are usable for training (clips in the train file, and in the
validation file unless ``--val_fraction 0``), or when a ``--shard`` run has recorded its
part; 1 when they were written but are not (no usable clip, or one side of the split is
empty; the output says why and what to run); 2 for a user's mistake, found before anything
is probed (a flag out of range, DIR not a folder, existing output files without ``--force``,
a split with other settings than the files record without ``--resplit``, a malformed
``--shard``, missing or mismatched parts for ``--merge``, a malformed ``--shard_size``, an
``OUT`` that cannot be written) or when writing fails
(no space, no permission; the train, val and skipped files are replaced together or not
at all, so the former ones stay whole): ``error: ...`` on stderr; 130 when stopped by Ctrl+C (the
records so far are kept).
"""

from __future__ import annotations

import re
import shlex
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from taehv_train.base.errors import UserError, counts_in_words, exit_on_user_error
from taehv_train.base.process_exit import exit_without_teardown
from taehv_train.common.video.files import find_videos
from taehv_train.training.annotate.annotation_files import Annotated, output_paths, write_outputs
from taehv_train.training.annotate.annotation_split import (
    Split,
    count,
    group_key,
    kept_sides,
    recorded_split,
    split_problem,
)
from taehv_train.training.annotate.cli import make_parser, parse
from taehv_train.training.annotate.commands import train_command
from taehv_train.training.annotate.packing import Packing, pack_clips, packing_plan, print_packed
from taehv_train.training.annotate.probe_pool import DEFAULT_PROBE_TIMEOUT, probe_all
from taehv_train.training.annotate.probe_records import (
    PROBES_FORMAT,
    ProbeRecords,
    RecordWriter,
    file_identity,
    parse_shard,
    probe_record,
    probes_path,
    read_parts,
    read_probes,
    records_of,
    same_file,
    shard_of,
)

EXIT_INTERRUPTED = 130


def reusable(rel: str, identity: dict[str, int | None], earlier: Sequence[ProbeRecords]) -> dict | None:
    """The record of ``rel`` in ``earlier`` that was made of the file as it is now (one that
    did not time out or crash, where there is one), or None."""
    matches = [r for part in earlier if (r := part.records.get(rel)) is not None and same_file(r, identity)]
    return min(matches, key=lambda r: bool(r.get("retry")), default=None)


def probe_folder(
    root: Path,
    rel_paths: Sequence[str],
    earlier: Sequence[ProbeRecords],
    records_file: Path,
    header: dict,
    workers: int,
    timeout: float,
    what: str,
    retry: bool = True,
) -> dict[str, dict]:
    """The probe record of every file of ``rel_paths``: reused from ``earlier`` where one
    was made of the file as it is now (same size, mtime_ns and permission bits), probed
    otherwise; all of them written to the records file as they come. With ``retry``, files
    that timed out or crashed their worker are probed again (that can be transient)."""
    identities = {rel: file_identity(root / rel) for rel in rel_paths}
    found = {rel: r for rel in rel_paths if (r := reusable(rel, identities[rel], earlier)) is not None}
    retried = sum(1 for r in found.values() if retry and r.get("retry"))
    reused = {rel: {**r, **identities[rel]} for rel, r in found.items() if not (retry and r.get("retry"))}
    to_probe = [rel for rel in rel_paths if rel not in reused]
    gone = len({rel for part in earlier for rel in part.records}.difference(rel_paths))
    records = dict(reused)
    writer = RecordWriter(records_file, header, reused.values())
    try:
        probes = probe_all(root, to_probe, workers, timeout)
        for probe in tqdm(probes, total=len(to_probe), desc=f"probing {what}", unit="file"):
            records[probe.rel] = record = probe_record(probe, identities[probe.rel])
            writer.add(record)
        writer.finish()
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: {writer.count} probe records are kept in {writer.path}; "
            "the same command continues from there",
            file=sys.stderr,
        )
        raise
    finally:
        writer.close()
    again = f" (and {retried} that timed out or crashed last time)" if retried else ""
    dropped = f", dropped the records of {count(gone, 'file')} now gone" if gone else ""
    print(
        f"probed {len(to_probe) - retried} new or changed files{again}, reused {len(reused)}{dropped} -> {writer.path}"
    )
    return records


def warn_of_ignored_lines(part: ProbeRecords) -> None:
    """One line per records file with lines that are no valid record (damaged, or a result
    that makes no sense such as ``frames: -7``): they are ignored and their files probed again."""
    if part.ignored:
        shown = "; ".join(part.ignored[:3]) + ("; ..." if len(part.ignored) > 3 else "")
        print(
            f"warning: {part.path.name}: {count(len(part.ignored), 'line')} ignored as no valid probe record "
            f"({shown}): their files are probed again",
            file=sys.stderr,
        )


def previous_records(records_file: Path, root: Path, force: bool) -> ProbeRecords | None:
    """The records file this run continues, if any; one of another DIR is refused (a user's
    mistake, most likely another -o was meant), or started over with ``force``."""
    previous = read_probes(records_file) if records_file.exists() else None
    if previous is None or previous.header["dir"] == str(root):
        return previous
    if not force:
        raise UserError(
            f"{records_file} holds the probes of {previous.header['dir']}, not of {root}: "
            "pass --force to start over, or another -o"
        )
    return None


def files_to_annotate(
    root: Path, images: bool, shard: tuple[int, int] | None, group: re.Pattern[str] | None = None
) -> tuple[list[str], bool]:
    """The files under ``root`` this run annotates (of ``shard`` only, if given: by the
    hash of their path, or of their source ``group`` when given, so that a group stays on
    one machine), and whether still images are among them: a folder with images and no
    videos gets its images without ``--images`` (a note says so)."""
    rel_paths = find_videos(root, images)
    if not rel_paths and not images and (rel_paths := find_videos(root, images=True)):
        images = True
        print(f"note: no videos under {root}: annotating its {len(rel_paths)} still images (one frame each)")
    if shard is not None:
        found = len(rel_paths)
        rel_paths = [rel for rel in rel_paths if shard_of(group_key(rel, group), shard[1]) == shard[0]]
        what = "videos and images" if images else "videos"
        print(f"shard {shard[0]}/{shard[1]}: {len(rel_paths)} of the {found} {what} under {root}")
    return rel_paths, images


def annotate(
    directory: Path,
    output: Path,
    split: Split,
    *,
    min_frames: int = 1,
    workers: int = 1,
    probe_timeout: float = DEFAULT_PROBE_TIMEOUT,
    images: bool = False,
    force: bool = False,
    resplit: bool = False,
    shard: tuple[int, int] | None = None,
    merge: bool = False,
    part: tuple[int, int] | None = None,
) -> Annotated | None:
    """Probe the files under ``directory`` and write the train, val and skipped files next to
    ``output``: with ``shard`` only its part's records (and None is returned); with
    ``merge`` from the parts' records, probing only the files that are new or changed since
    their shard ran, as a plain run does (the records of all go to the plain run's records
    file); with ``part`` (K, N) as a plain run on the files of part K of N, chosen by their
    source group so that the part's split keeps groups whole (``--to_shards`` with
    ``--shard``). Each refusal, a UserError, comes before anything is probed or written."""
    if output.is_dir():
        raise UserError(f"-o {output} is a folder: name a file, e.g. {output / 'annotations.json'}")
    paths = output_paths(output.absolute())
    root = directory.resolve()
    parts = read_parts(output, root) if merge else []
    records_file = probes_path(output, shard)
    previous = previous_records(records_file, root, force)
    ours = records_of(output, root)  # the files next to -o are this tool's for DIR
    if shard is None and not force and not ours and (there := [p.name for p in paths.values() if p.exists()]):
        raise UserError(
            f"{output.parent} already holds {', '.join(there)}: pass --force to replace them, or another -o"
        )
    if shard is None:
        known, split_note = kept_sides(recorded_split(paths) if ours and not resplit else None, split, resplit)

    images = parts[0].header["images"] if parts else images
    rel_paths, images = files_to_annotate(root, images, shard or part, split.pattern if part else None)
    what = "videos and images" if images else "videos"
    if parts:
        print(f"merged {len(parts)} probe parts: {sum(len(p.records) for p in parts)} {what}")
    header = {
        "make_annotations_probes": PROBES_FORMAT,
        "dir": str(root),
        "shard": list(shard) if shard else None,
        "images": images,
    }
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot write next to {output}: {err.strerror or err}") from None
    earlier = [*parts, *([previous] if previous is not None else [])]
    for part in earlier:
        warn_of_ignored_lines(part)
    # a merge probes only what changed since the shards ran; a time-out is retried by its shard
    records = probe_folder(
        root, rel_paths, earlier, records_file, header, workers, probe_timeout, what, retry=not merge
    )
    if shard is not None:
        return None
    records_name = records_file.name + (
        f" (with the {len(parts)} parts {output.stem}_probes.shard-K-of-{len(parts)}.jsonl)" if parts else ""
    )

    train, val, skipped = write_outputs(paths, records.values(), min_frames, split, known)
    kept = sorted(e["path"] for e in train + val)
    problem = split_problem(kept, split, len(val)) if kept else None
    return Annotated(root, paths, records_name, what, len(records), train, val, skipped, split_note, problem)


def tool_command(args: Sequence[str]) -> str:
    """This tool's command line with ``args``, with this interpreter: it works from any
    folder (the arguments keep their meaning there, as the user typed them there)."""
    return shlex.join([sys.executable, "-m", __spec__.name, *args])


def pack_and_report(annotated: Annotated, packing: Packing, argv: list[str], train_line: bool) -> int:
    """Pack the annotated clips into shards under ``packing.out``, report both, and with
    ``train_line`` print the command that trains on the shards; the exit status (``report``'s)."""
    packed = pack_clips(annotated, packing)
    status = report(annotated, argv, train_line=False)
    print_packed(packed, packing, train_line=status == 0 and train_line)
    return status


def main(argv: Sequence[str] | None = None, *, train_line: bool = True) -> int:
    parser = make_parser(__doc__)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(parser, argv)
    shard = parse_shard(args.shard) if args.shard is not None else None
    if args.shard_size is not None and not args.to_shards:
        raise UserError("--shard_size goes with --to_shards OUT: name where the shards go")
    packing = packing_plan(args.to_shards, args.shard_size, args.output, shard, args.merge) if args.to_shards else None
    if packing is None and args.output is None:
        parser.error("the following arguments are required: -o/--output (or --to_shards OUT)")
    split = Split(args.val_fraction, args.seed, args.group_regex)
    annotated = annotate(
        args.directory,
        packing.output if packing else args.output,
        split,
        min_frames=args.min_frames,
        workers=args.workers,
        probe_timeout=args.probe_timeout,
        images=args.images,
        force=args.force,
        resplit=args.resplit,
        shard=None if packing else shard,
        merge=args.merge,
        part=shard if packing else None,
    )
    if packing is not None:
        return pack_and_report(annotated, packing, argv, train_line)
    if annotated is None:
        print(
            f"part {shard[0]} of {shard[1]} done: once all {shard[1]} are, "
            "run the same command with --merge instead of --shard"
        )
        return 0
    return report(annotated, argv, train_line)


def report(annotated: Annotated, argv: list[str], train_line: bool) -> int:
    """Print what was written and, with ``train_line``, the command that trains on it; the
    exit status (1: nothing to train on)."""
    train, val, skipped, paths = annotated.train, annotated.val, annotated.skipped, annotated.paths
    kept = len(train) + len(val)
    print(f"found {annotated.found} {annotated.what} under {annotated.root}: kept {kept}, skipped {len(skipped)}")
    print(
        f"wrote in {paths['train'].parent}: {paths['train'].name} ({count(len(train), 'clip')} for training), "
        f"{paths['val'].name} ({count(len(val), 'clip')} held out for validation), "
        f"{paths['skipped'].name} ({count(len(skipped), 'file')} left out); probe records: {annotated.records}"
    )
    print(annotated.split_note)
    if skipped:
        reasons = Counter(s["reason"].split(":")[0] for s in skipped)
        print(f"skipped {counts_in_words(reasons)}:")
        for s in skipped[:20]:
            print(f"  {s['path']}: {s['reason']}")
        if len(skipped) > 20:
            print(f"  ... and {len(skipped) - 20} more")
    if not kept:
        print(f"no usable {annotated.what}: nothing to train on")
        return 1
    if annotated.problem is not None:
        message, flags = annotated.problem
        # no --force: the records file next to the annotations lets the same -o be rewritten;
        # --resplit where the empty side is training's: no run can have trained on it
        resplit = ["--resplit"] if flags and val and "--resplit" not in argv else []
        fix = (
            f"to fix it, run: {tool_command([*argv, *flags, *resplit])}"
            if flags
            else "add clips, or pass --val_fraction 0 and train without validation (no val_annotation_file)"
        )
        print(f"warning: {message}; {fix}", file=sys.stderr)
        return 1
    if train_line:
        print(f"train on them: {train_command(annotated)}")
    return 0


def _exit_with_status(argv: Sequence[str] | None = None) -> None:
    try:
        status = main(argv)
    except KeyboardInterrupt:  # the records so far are kept (probe_folder said so)
        status = EXIT_INTERRUPTED
    sys.exit(status)


if __name__ == "__main__":
    with exit_without_teardown():
        exit_on_user_error(_exit_with_status)
