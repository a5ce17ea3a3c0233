"""The probe records of ``make_annotations``: ``<out>_probes.jsonl``, or
``<out>_probes.shard-K-of-N.jsonl`` per ``--shard`` run. One JSON line per probed file,
keyed by its path and identity (size, mtime, permission bits), appended and flushed as
each probe ends: a re-run probes only new or changed files, a stopped run continues where
it stopped, and ``--merge`` reads the parts of a sharded run. A line that is no valid
record is ignored and counted (its file is probed again): one damaged line costs one
probe, not the whole file's."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from taehv_train.base.atomic import atomic_write
from taehv_train.base.errors import UserError
from taehv_train.training.annotate.probe_pool import Probe

PROBES_FORMAT = 1  # version of the records file: the header's "make_annotations_probes"
FSYNC_SECONDS = 5.0  # records reach the disk at least this often (a machine crash loses less)
IDENTITY = ("size", "mtime_ns", "mode")  # the stat fields a record is reused by


def file_identity(path: Path) -> dict[str, int | None]:
    """The identity of the file a path leads to, as its record stores it: size and mtime_ns
    (a changed file) and mode (a chmod that makes an unreadable file readable changes
    neither of the others); all None when stat fails (a missing file or a broken link:
    ``probe_all`` reports it with the reason). Not the owner: shard machines whose user
    mappings differ would see other owners of the same files, and the merge would probe
    them all again."""
    try:
        st = os.stat(path)
    except OSError:
        return dict.fromkeys(IDENTITY)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "mode": st.st_mode}


def same_file(record: dict, identity: dict[str, int | None]) -> bool:
    """Whether ``record`` was made of the file as it is now. Fields a record lacks (an
    older make_annotations recorded size and mtime_ns only) are not compared."""
    return all(record.get(field, value) == value for field, value in identity.items())


def shard_of(rel: str, n: int) -> int:
    """The shard (1..n) a file belongs to, from its path alone (sha256: the same on every
    machine and Python, whatever else the folder holds)."""
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") % n + 1


def parse_shard(text: str) -> tuple[int, int]:
    """``K/N`` with 1 <= K <= N."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match:
        raise UserError(f"--shard {text!r}: expected K/N, e.g. --shard 1/8 (this machine's part K of N)")
    k, n = int(match[1]), int(match[2])
    if not 1 <= k <= n:
        raise UserError(f"--shard {text}: K must be between 1 and N ({n})")
    return k, n


def probes_path(out: Path, shard: tuple[int, int] | None = None) -> Path:
    tail = f".shard-{shard[0]}-of-{shard[1]}" if shard else ""
    return out.with_name(f"{out.stem}_probes{tail}.jsonl")


@dataclass
class ProbeRecords:
    """A records file as read: its header, the last valid record per path, whether its run
    ended, and the lines ignored as no valid record (``"line N: why"``)."""

    path: Path
    header: dict
    records: dict[str, dict]
    complete: bool
    ignored: list[str]


def _whole(value: object, least: int | None = None) -> bool:
    """An int (not a bool) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and (least is None or value >= least)


def _is_header(header: object) -> bool:
    """Whether ``header`` is the first line of a records file of this tool."""
    return (
        isinstance(header, dict)
        and header.get("make_annotations_probes") == PROBES_FORMAT
        and isinstance(header.get("dir"), str)
        and isinstance(header.get("images"), bool)
        and (header.get("shard") is None or (isinstance(header["shard"], list) and len(header["shard"]) == 2))
    )


def _probe_problem(probe: object) -> str | None:
    """What makes a record's probe result nonsense (``frames -7``), or None."""
    if not isinstance(probe, dict):
        return "neither a probe nor a skip reason"
    if not isinstance(probe.get("full_path"), str):
        return "a probe without its full_path"
    for field in ("frames", "width", "height"):
        if not _whole(probe.get(field), 1):
            return f"{field} {probe.get(field)!r}"
    fps = probe.get("fps")
    if not (isinstance(fps, (int, float)) and not isinstance(fps, bool) and math.isfinite(fps) and fps >= 0):
        return f"fps {fps!r}"
    return None


def record_problem(record: dict) -> str | None:
    """Why a line of a records file is no record to trust, or None: a record holds a path,
    the file's identity (whole numbers, or None where stat failed) and either a skip reason
    or a probe result that makes sense (frames, width and height of at least 1, a finite
    fps of at least 0)."""
    if not isinstance(record.get("path"), str):
        return "no path"
    if "size" not in record or "mtime_ns" not in record:
        return "no size or mtime_ns"
    for field in IDENTITY:
        if record.get(field) is not None and not _whole(record[field], None if field == "mtime_ns" else 0):
            return f"{field} {record[field]!r}"
    if "skip" in record:
        return None if isinstance(record["skip"], str) else "a skip reason that is not text"
    return _probe_problem(record.get("probe"))


def _json_object(line: bytes) -> dict | None:
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested beyond Python's stack
        return None
    return value if isinstance(value, dict) else None


def read_probes(path: Path) -> ProbeRecords:
    """Read a records file. A line that is no valid record is ignored and listed in
    ``ignored`` (its file is probed again), a last line without its newline silently (a
    write a kill cut short); a file whose first line is no header of this tool is refused."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    lines.pop()  # after the last newline: empty, or the line a kill tore
    if not lines or not _is_header(header := _json_object(lines[0])):
        raise UserError(f"{path} is not a probe record file of this make_annotations: delete it, or use another -o")
    records: dict[str, dict] = {}
    ignored: list[str] = []
    complete = False
    for number, line in enumerate(lines[1:], 2):
        entry = _json_object(line)
        complete = entry is not None and set(entry) == {"complete"}
        if complete:
            continue
        if problem := "not a JSON object" if entry is None else record_problem(entry):
            ignored.append(f"line {number}: {problem}")
        else:
            records[entry["path"]] = entry
    return ProbeRecords(path, header, records, complete, ignored)


class RecordWriter:
    """Writes a records file: the header and the reused records go to a temporary file that
    then replaces the old one (a kill meanwhile leaves the old one whole), then each new
    record is appended and flushed as it arrives, so a kill loses only the files in flight."""

    def __init__(self, path: Path, header: dict, reused: Iterable[dict]):
        reused = list(reused)
        self.path, self.count = path, len(reused)

        def start(temporary: Path) -> None:
            with open(temporary, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(record) + "\n" for record in (header, *reused))

        self._attempt(lambda: atomic_write(path, start))
        self.file: TextIO = self._attempt(lambda: open(path, "a", encoding="utf-8"))
        self.synced = 0.0

    def _attempt(self, action):
        try:
            return action()
        except OSError as err:  # no space, no permission, a read-only file system: the user's to fix
            raise UserError(f"cannot write the probe records {self.path}: {err.strerror or err}") from None

    def _write(self, record: dict) -> None:
        # ASCII escapes: a file name that is not UTF-8 (a surrogate escape) reads back the same
        self._attempt(lambda: self.file.write(json.dumps(record) + "\n"))

    def add(self, record: dict) -> None:
        self._write(record)
        self.count += 1
        self._attempt(self.file.flush)
        if time.monotonic() - self.synced > FSYNC_SECONDS:
            self._attempt(lambda: os.fsync(self.file.fileno()))
            self.synced = time.monotonic()

    def finish(self) -> None:
        """Mark the run complete (``--merge`` requires it of every part)."""
        self._write({"complete": self.count})
        self._attempt(lambda: (self.file.flush(), os.fsync(self.file.fileno())))

    def close(self) -> None:
        self.file.close()


def probe_record(probe: Probe, identity: dict[str, int | None]) -> dict:
    record: dict = {"path": probe.rel, **identity}
    if probe.info is not None:
        record["probe"] = probe.info
    else:
        record["skip"] = probe.reason
        if probe.retry:
            record["retry"] = True
    return record


def part_files(out: Path) -> dict[tuple[int, int], Path]:
    """The records files of ``--shard`` runs next to ``out``, by (K, N)."""
    name = re.compile(re.escape(out.stem) + r"_probes\.shard-(\d+)-of-(\d+)\.jsonl")
    if not out.parent.is_dir():
        return {}
    return {(int(m[1]), int(m[2])): p for p in out.parent.iterdir() if (m := name.fullmatch(p.name))}


def records_of(out: Path, root: Path) -> bool:
    """Whether a records file next to ``out`` (of a plain or a ``--shard`` run) is of DIR
    ``root``: then the annotation files there are this tool's for it, and may be replaced."""
    for path in [probes_path(out), *part_files(out).values()]:
        if path.exists():
            with open(path, "rb") as f:
                first = f.readline()
            header = first.startswith(b'{"make_annotations_probes": ') and first.endswith(b"\n")
            if header and json.loads(first).get("dir") == str(root):
                return True
    return False


def read_parts(out: Path, root: Path) -> list[ProbeRecords]:
    """The N parts of a sharded run next to ``out``; one line of refusal when a part is
    missing or incomplete, parts of different N lie there, or a part is of another DIR or
    was listed with other flags."""
    found = part_files(out)
    if not found:
        raise UserError(
            f"no probe parts next to {out} ({out.stem}_probes.shard-K-of-N.jsonl): "
            "run --shard K/N for K = 1..N first, with the same -o"
        )
    counts = sorted({n for _, n in found})
    if len(counts) > 1:
        raise UserError(
            f"{out.parent} holds probe parts of {' and of '.join(map(str, counts))} shards for {out.name}: "
            "delete the parts of the sharding no longer in use"
        )
    n = counts[0]
    if missing := [k for k in range(1, n + 1) if (k, n) not in found]:
        runs = ", ".join(f"--shard {k}/{n}" for k in missing)
        raise UserError(f"{len(missing)} of the {n} probe parts are missing next to {out}: run {runs}")
    parts = [read_probes(found[k, n]) for k in range(1, n + 1)]
    for k, part in enumerate(parts, 1):
        if part.header["dir"] != str(root):
            raise UserError(f"{part.path} holds the probes of {part.header['dir']}, not of {root}: merge that DIR")
        if part.header["shard"] != [k, n]:
            raise UserError(
                f"{part.path} holds the probes of shard {part.header['shard']}, not {k}/{n}: rename or delete it"
            )
        if part.header["images"] != parts[0].header["images"]:
            raise UserError(
                f"{part.path.name} and {parts[0].path.name} were listed with and without still images: "
                "run all shards with the same flags"
            )
        if not part.complete:
            raise UserError(f"{part.path} is incomplete (its run was stopped): run --shard {k}/{n} again to finish it")
    return parts
