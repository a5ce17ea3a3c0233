"""Packing annotated clips into tar shards that a run reads from disk or object storage.

The layout is the one video2dataset writes (``video2dataset/data_writer.py``,
``WebDatasetSampleWriter``: shard ``{n:05d}.tar`` under an fsspec URL, per sample
``{key}.mp4`` beside ``{key}.json``): each clip's file goes in as it is, no re-encode, as
``{key}.{its extension}``, and its probe as ``{key}.json``. WebDataset groups members into
samples by the base name up to its first "." (``webdataset/tariterators.py``,
``base_plus_ext``), so a key holds no "."; it is a hash of the clip's path relative to the
packed folder, the same on every machine, so parts packed in parallel never share a key.

A shard is finished when its sidecar ``<shard>.index.json`` (``common.shard_index``) lies
beside it: the sidecar is written only once the shard is complete, and gives each video
member's data offset and size in the tar, so a run reads a clip with one byte-range
request. A shard without a sidecar (a killed run) is unfinished: the next run of its part
removes it and packs its clips again. Local shards are written under a temporary name and
renamed; on object storage a shard appears only when its upload completes (an fsspec
transaction: a failed or interrupted upload is discarded).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from tqdm import tqdm

from taehv_train.base.atomic import TMP_PREFIX, atomic_write
from taehv_train.base.errors import UserError
from taehv_train.common.shard_index import INDEX_SUFFIX, ShardIndex, ShardMember, index_from_text, index_text

logger = logging.getLogger(__name__)
T = TypeVar("T")

SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
SIZE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
DEFAULT_SHARD_SIZE = "1GB"  # webdataset's own ShardWriter rolls over at 3e9 bytes (webdataset/writer.py, maxsize)
PROBE_FIELDS = ("frames", "width", "height", "fps", "duration")  # of an annotation entry, into the clip's JSON


def parse_size(text: str) -> int:
    """Bytes of a size such as "1GB" (10**9), "500MB", "1GiB" (2**30) or "4096"; UserError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match[2].upper() if match else None
    if match is None or unit not in SIZE_UNITS or (size := int(float(match[1]) * SIZE_UNITS[unit])) < 1:
        raise UserError(
            f"--shard_size {text!r}: expected a size such as 1GB, 500MB, 1GiB or a number of bytes (at least 1)"
        )
    return size


def clip_key(rel: str) -> str:
    """The sample key of the clip at ``rel`` (relative to the packed folder): hex, no "."."""
    return hashlib.sha256(rel.encode()).hexdigest()[:20]


def part_prefix(part: tuple[int, int] | None) -> str:
    """How the shards of machine K of N are named (``part-K-of-N-00000.tar``; alone: ``00000.tar``)."""
    return f"part-{part[0]}-of-{part[1]}-" if part else ""


def _padded(size: int) -> int:
    return -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def _tar_bytes(payload: int) -> int:
    """A tar's size with ``payload`` bytes of headers and padded data: the end blocks, padded to a record."""
    return -(-(payload + 2 * tarfile.BLOCKSIZE) // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


@dataclass(frozen=True)
class Clip:
    """One clip to pack: its file, key and JSON."""

    source: Path
    key: str
    extension: str  # ".mp4", lower case
    meta: dict

    @property
    def json_bytes(self) -> bytes:
        return json.dumps(self.meta, ensure_ascii=False).encode()

    def tar_payload(self) -> int:
        """Bytes the clip takes in a tar: a header and the padded data of each of its two members."""
        return 2 * tarfile.BLOCKSIZE + _padded(self.source.stat().st_size) + _padded(len(self.json_bytes))


def clip_of(root: Path, entry: dict) -> Clip:
    """The clip of an annotation entry (``make_annotations``'s): its JSON holds the key, the
    path relative to ``root`` and the probe's fields."""
    rel = entry["path"]
    key = clip_key(rel)
    meta = {"key": key, "path": rel} | {field: entry[field] for field in PROBE_FIELDS if field in entry}
    return Clip(root / rel, key, Path(rel).suffix.lower(), meta)


def write_tar(f: IO[bytes], clips: Sequence[Clip], url: str) -> ShardIndex:
    """Write ``clips`` to ``f`` as the tar shard at ``url``; its index."""
    members = []
    with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for clip in clips:
            with open(clip.source, "rb") as data:
                size = data.seek(0, 2)
                data.seek(0)
                info = tarfile.TarInfo(clip.key + clip.extension)
                info.size, info.mode = size, 0o644
                tar.addfile(info, data)
            offset = f.tell() - _padded(size)
            meta = clip.meta
            members.append(
                ShardMember(
                    key=clip.key,
                    name=info.name,
                    offset=offset,
                    size=size,
                    frames=meta["frames"],
                    width=meta["width"],
                    height=meta["height"],
                    fps=float(meta.get("fps", 0.0)),
                    path=meta["path"],
                )
            )
            info = tarfile.TarInfo(f"{clip.key}.json")
            info.size, info.mode = len(clip.json_bytes), 0o644
            tar.addfile(info, io.BytesIO(clip.json_bytes))
    return ShardIndex(url, f.tell(), tuple(members))


class ShardFolder:
    """The shards of one side (train or val) under a local folder or an fsspec URL."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.path = fsspec.core.url_to_fs(self.url)
        self.local = isinstance(self.fs, LocalFileSystem)

    def check_writable(self) -> None:
        """Write and remove a small file here (a missing bucket, credentials that may not
        write, a read-only folder: OSError), before hours of probing."""
        check = f"{self.path}/{TMP_PREFIX}write-check"
        if self.local:
            Path(self.path).mkdir(parents=True, exist_ok=True)
        self.fs.pipe_file(check, b"")
        self.fs.rm(check)

    def shard_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def names(self) -> list[str]:
        """The names of the files in the folder (none when it does not exist yet)."""
        if not self.fs.exists(self.path):
            return []
        return sorted(Path(p).name for p in self.fs.ls(self.path, detail=False))

    def finished(self) -> list[ShardIndex]:
        """The index of every finished shard here (of every part), by name."""
        names = set(self.names())
        return [
            index_from_text(self.shard_url(name), self.fs.cat_file(f"{self.path}/{name}{INDEX_SUFFIX}").decode())
            for name in sorted(names)
            if name.endswith(".tar") and name + INDEX_SUFFIX in names
        ]

    def remove_unfinished(self, prefix: str) -> list[str]:
        """Remove this part's shards that have no sidecar (a killed run's, or their temporary
        files); their names."""
        names = set(self.names())
        pattern = re.compile(rf"(?:{re.escape(TMP_PREFIX)})?{re.escape(prefix)}\d+\.tar")
        gone = [n for n in sorted(names) if pattern.fullmatch(n) and n + INDEX_SUFFIX not in names]
        for name in gone:
            self.fs.rm(f"{self.path}/{name}")
        return gone

    def write(self, name: str, fill: Callable[[IO[bytes]], T]) -> T:
        """Write file ``name`` with ``fill`` (what it returns is returned): the file appears
        whole or not at all."""
        target = f"{self.path}/{name}"
        if not self.local:
            with self.fs.transaction, self.fs.open(target, "wb") as f:
                return fill(f)
        Path(self.path).mkdir(parents=True, exist_ok=True)
        result: list[T] = []

        def to_file(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                result.append(fill(f))

        atomic_write(target, to_file)
        return result[0]


def shard_number(name: str, prefix: str) -> int | None:
    match = re.fullmatch(rf"{re.escape(prefix)}(\d+)\.tar", name)
    return int(match[1]) if match else None


def batches(clips: Sequence[Clip], shard_size: int) -> list[list[Clip]]:
    """``clips`` in order, cut into shards of at most ``shard_size`` bytes each (a clip
    larger than that gets a shard of its own)."""
    shards: list[list[Clip]] = []
    payload = 0
    for clip in clips:
        cost = clip.tar_payload()
        if not shards or _tar_bytes(payload + cost) > shard_size:
            shards.append([])
            payload = 0
        shards[-1].append(clip)
        payload += cost
    return shards


@dataclass(frozen=True)
class Packed:
    """What ``pack`` found and wrote in one side's folder."""

    url: str
    removed: list[str]  # names of the unfinished shards removed
    new_shards: list[str]  # names
    new_clips: int
    shards: int  # finished shards in the folder, of every part
    clips: int  # clips in them


def pack(
    root: Path, sides: dict[str, Sequence[dict]], out: str, shard_size: int, part: tuple[int, int] | None = None
) -> dict[str, Packed]:
    """Pack the clips of ``sides`` (side -> annotation entries of files under ``root``)
    into shards of at most ``shard_size`` bytes under ``out``/side, those of this ``part``
    named by ``part_prefix``: only clips in no finished shard under ``out`` (of any side or
    part), in new shards numbered after the part's last finished one; the part's
    unfinished shards are removed first."""
    prefix = part_prefix(part)
    folders = {side: ShardFolder(f"{out.rstrip('/')}/{side}") for side in sides}
    removed = {side: folder.remove_unfinished(prefix) for side, folder in folders.items()}
    finished = {side: folder.finished() for side, folder in folders.items()}
    packed = {member.path for indexes in finished.values() for index in indexes for member in index.members}
    result = {}
    for side, entries in sides.items():
        todo = [clip_of(root, entry) for entry in entries if entry["path"] not in packed]
        numbers = [n for index in finished[side] if (n := shard_number(Path(index.url).name, prefix)) is not None]
        written = _write_shards(folders[side], todo, shard_size, prefix, max(numbers, default=-1) + 1)
        before = sum(len(index.members) for index in finished[side])
        shards = len(finished[side]) + len(written)
        result[side] = Packed(folders[side].url, removed[side], written, len(todo), shards, before + len(todo))
    return result


def _write_shards(folder: ShardFolder, clips: Sequence[Clip], shard_size: int, prefix: str, first: int) -> list[str]:
    """Write ``clips`` into shards numbered from ``first``, each followed by its sidecar; their names."""
    written = []
    with tqdm(total=len(clips), desc=f"packing {Path(folder.url).name}", unit="clip", disable=not clips) as bar:
        for number, batch in enumerate(batches(clips, shard_size), start=first):
            name = f"{prefix}{number:05d}.tar"
            index = folder.write(name, partial(write_tar, clips=batch, url=folder.shard_url(name)))
            sidecar = index_text(index).encode()
            folder.write(name + INDEX_SUFFIX, lambda f, data=sidecar: f.write(data))
            written.append(name)
            logger.info("packed %d clips into %s", len(batch), folder.shard_url(name))
            bar.update(len(batch))
    return written
