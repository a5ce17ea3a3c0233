"""The probe records of ``make_annotations``: ``<out>_probes.jsonl``, or
``<out>_probes.shard-K-of-N.jsonl`` per ``--shard`` run. One JSON line per probed file,
keyed by its path, size and mtime, appended and flushed as each probe ends: a re-run
probes only new or changed files, a stopped run continues where it stopped, and
``--merge`` reads the parts of a sharded run."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from common.errors import UserError
from training.data.probe_pool import Probe

PROBES_FORMAT = 1  # version of the records file: the header's "make_annotations_probes"
FSYNC_SECONDS = 5.0  # records reach the disk at least this often (a machine crash loses less)
Key = tuple[int | None, int | None]  # (size, mtime_ns) of the file; (None, None) when stat fails


def file_key(path: Path) -> Key:
    """``(size, mtime_ns)`` of the file a path leads to; ``(None, None)`` when stat fails (a
    missing file or a broken link: ``probe_all`` reports it with the reason)."""
    try:
        st = os.stat(path)
    except OSError:
        return None, None
    return st.st_size, st.st_mtime_ns


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
    """A records file as read: its header, the last record per path, whether its run ended."""

    path: Path
    header: dict
    records: dict[str, dict]
    complete: bool


def read_probes(path: Path) -> ProbeRecords:
    """Read a records file. A last line without its newline is a write a kill cut short: it
    is ignored (that file is probed again); any other line that is no record is refused."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    lines.pop()  # after the last newline: empty, or the line a kill tore
    parsed: list[dict] = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or (number > 1 and "path" not in record and "complete" not in record):
            raise UserError(f"{path}, line {number}: not a probe record: delete the file to probe everything again")
        parsed.append(record)
    if not parsed or parsed[0].get("make_annotations_probes") != PROBES_FORMAT:
        raise UserError(f"{path} is not a probe record file of this make_annotations: delete it, or use another -o")
    records = {r["path"]: r for r in parsed[1:] if "path" in r}
    complete = parsed[-1].get("complete") == len(records)
    return ProbeRecords(path, parsed[0], records, complete)


class RecordWriter:
    """Writes a records file: the header and the reused records go to a temporary file that
    then replaces the old one (a kill meanwhile leaves the old one whole), then each new
    record is appended and flushed as it arrives, so a kill loses only the files in flight."""

    def __init__(self, path: Path, header: dict, reused: Iterable[dict]):
        self.path, self.count = path, 0
        temporary = path.with_name(path.name + ".tmp")
        self.file: TextIO = self._attempt(lambda: open(temporary, "w", encoding="utf-8"))
        self._write(header)
        for record in reused:
            self.add(record, flush=False)
        self.synced = 0.0
        self._attempt(lambda: (self.file.flush(), os.fsync(self.file.fileno()), os.replace(temporary, path)))

    def _attempt(self, action):
        try:
            return action()
        except OSError as err:  # no space, no permission, a read-only file system: the user's to fix
            raise UserError(f"cannot write the probe records {self.path}: {err.strerror or err}") from None

    def _write(self, record: dict) -> None:
        # ASCII escapes: a file name that is not UTF-8 (a surrogate escape) reads back the same
        self._attempt(lambda: self.file.write(json.dumps(record) + "\n"))

    def add(self, record: dict, flush: bool = True) -> None:
        self._write(record)
        self.count += 1
        if flush:
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


def probe_record(probe: Probe, key: Key) -> dict:
    record: dict = {"path": probe.rel, "size": key[0], "mtime_ns": key[1]}
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


def read_parts(out: Path, root: Path) -> tuple[list[ProbeRecords], dict[str, dict]]:
    """The N parts of a sharded run next to ``out`` and their records; one line of
    refusal when a part is missing or incomplete, parts of different N lie there, or a
    part is of another DIR or was listed with other flags."""
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
    return parts, {rel: r for part in parts for rel, r in part.records.items()}
