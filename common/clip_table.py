"""``ClipTable``: the clips a dataset draws from (paths and frame counts), from a users'
annotation file or a scanned folder, stored so forked DataLoader workers share it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from taehv_train.common.annotation_file import read_annotation
from taehv_train.common.shard_index import ShardIndex, load_index
from taehv_train.common.shard_source import (
    RETRY,
    RetryPolicy,
    ShardReadError,
    expand_shards,
    is_shard_source,
    read_range,
)
from taehv_train.common.video.files import BadClipError, Clip, ClipBytes, clip_extensions, find_videos

MAX_FRAMES = int(np.iinfo(np.int32).max)  # frame counts are int32; no real clip comes near (2.3 years at 30 fps)


@dataclass(frozen=True)
class ClipTable:
    """Paths and frame counts of all clips as three numpy arrays.

    A list of millions of dicts would be copied page by page into every forked worker as
    reference counts change; flat arrays are never written to, so workers share them.
    ``frames`` is -1 where unknown (the container's count is used at load time).

    Clips in tar shards are named ``<shard URL>#<member>`` and read by byte range:
    ``shards`` lists the shard URLs, ``shard_of`` each clip's shard and ``ranges`` its
    member's (offset, size); clips lie in shard order, in each shard as in its tar.
    """

    root: str
    path_bytes: np.ndarray  # uint8, all paths UTF-8 encoded back to back
    offsets: np.ndarray  # int64, len(table) + 1
    frames: np.ndarray  # int32
    refused: tuple[tuple[str, str], ...] = ()  # annotation entries left out: (path as written, why)
    shards: tuple[str, ...] = ()
    shard_of: np.ndarray | None = None  # int32 per clip, into shards
    ranges: np.ndarray | None = None  # int64 (clips, 2): the member's offset and size in its shard
    retry: RetryPolicy = RETRY  # how reads from the shards retry a transient fault

    @classmethod
    def from_lists(
        cls, root: str | Path, paths: Sequence[str], frames: Sequence[int], refused: Sequence[tuple[str, str]] = ()
    ) -> ClipTable:
        encoded = [p.encode("utf-8") for p in paths]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        path_bytes = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        return cls(str(root), path_bytes, offsets, np.asarray(frames, dtype=np.int32), tuple(refused))

    @classmethod
    def from_shards(cls, spec: str, retry: RetryPolicy = RETRY) -> ClipTable:
        """The clips of the tar shards ``spec`` names (``shard_source.expand_shards``), each
        shard's index read in parallel (object storage answers many requests at once). A
        shard that cannot be read is left out and listed in ``refused``."""
        urls = expand_shards(spec, retry=retry)
        with ThreadPoolExecutor(max_workers=16) as pool:
            found = list(pool.map(lambda url: _index_or_error(url, retry), urls))
        indexes = [index for index in found if isinstance(index, ShardIndex) and index.members]
        refused = [
            (url, f"shard {error.kind}: {error.detail}")
            for url, error in zip(urls, found, strict=True)
            if isinstance(error, ShardReadError)
        ]
        names = [f"{index.url}#{member.name}" for index in indexes for member in index.members]
        frames = [member.frames for index in indexes for member in index.members]
        shard_of = np.repeat(np.arange(len(indexes), dtype=np.int32), [len(index.members) for index in indexes])
        ranges = np.asarray([(m.offset, m.size) for index in indexes for m in index.members], dtype=np.int64)
        table = cls.from_lists("", names, frames, refused)
        shards = tuple(index.url for index in indexes)
        return replace(table, shards=shards, shard_of=shard_of, ranges=ranges.reshape(-1, 2), retry=retry)

    @classmethod
    def from_directory(cls, directory: str | Path, images: bool = False) -> ClipTable:
        """All videos (and with ``images`` still images) under ``directory``, frame counts
        unknown (read from the container)."""
        paths = find_videos(directory, images)
        return cls.from_lists(directory, paths, [-1] * len(paths))

    @classmethod
    def from_source(
        cls, data_root: str | Path | None, annotation_file: str | Path | None, retry: RetryPolicy = RETRY
    ) -> tuple[ClipTable, str]:
        """The clips a dataset reads: ``annotation_file`` (paths relative to ``data_root``),
        else the folder ``annotation_file`` or ``data_root`` scanned for videos and images;
        and that source as messages name it; either may name tar shards instead
        (``from_shards``). ValueError when neither is given."""
        if (shards := annotation_file or data_root) is not None and is_shard_source(str(shards)):
            return cls.from_shards(str(shards), retry), f"the shards {shards}"
        if annotation_file is not None and not Path(annotation_file).is_dir():
            return cls.from_annotation(annotation_file, data_root), str(annotation_file)
        if annotation_file is not None or data_root is not None:
            folder = annotation_file if annotation_file is not None else data_root
            return cls.from_directory(folder, images=True), f"{folder} (scanned for {', '.join(clip_extensions(True))})"
        raise ValueError("give annotation_file (a JSON annotation or a folder) or data_root (a folder of videos)")

    @classmethod
    def from_annotation(cls, annotation_file: str | Path, data_root: str | Path | None = None) -> ClipTable:
        """Users' format ``{"total": N, "list": [{"path" | "full_path", "frames", ...}]}``.

        With ``data_root``, ``path`` is taken relative to it (``full_path`` when there is
        no ``path``); without, ``full_path`` wins and ``path`` is relative to the
        annotation file's folder. Absolute paths are used as they are. A file of another
        shape is an ``AnnotationFileError`` (``read_annotation``). An entry whose ``frames``
        is not a positive whole number (missing or null: the container says) or is above
        ``MAX_FRAMES``, or whose relative path leaves the root (``../../etc/passwd``), is
        left out and listed in ``refused``.
        """
        annotation_file = Path(annotation_file)
        entries = read_annotation(annotation_file)["list"]
        if data_root is not None:
            keys = ("path", "full_path")
            root = str(data_root)
        else:
            keys = ("full_path", "path")
            root = str(annotation_file.resolve().parent)
        paths, frames, refused = [], [], []
        first, second = keys
        for i, entry in enumerate(entries):
            path, count = entry[first if first in entry else second], entry.get("frames")
            if type(count) is not int or not 1 <= count <= MAX_FRAMES:  # a bool, float, None, ...: look closer
                if isinstance(count, float) and count.is_integer():
                    count = int(count)
                if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
                    refused.append((path, f"entry {i}: frames={count!r} is not a positive whole number"))
                    continue
                if count is not None and count > MAX_FRAMES:
                    refused.append(
                        (path, f"entry {i}: frames={count} is more than any clip holds (at most {MAX_FRAMES})")
                    )
                    continue
            # only a path holding ".." can leave the root (normpath is the slow part of this loop)
            if ".." in path and not os.path.isabs(path) and os.path.normpath(path).split(os.sep)[0] == os.pardir:
                refused.append((path, f"entry {i}: {path} leaves {root}"))
            else:
                paths.append(path)
                frames.append(-1 if count is None else count)  # missing/null: ask the container
        return cls.from_lists(root, paths, frames, refused)

    def __len__(self) -> int:
        return len(self.frames)

    def subset(self, indices: Sequence[int]) -> ClipTable:
        """The clips at ``indices``, in that order."""
        relative = [self.path_bytes[self.offsets[i] : self.offsets[i + 1]].tobytes().decode("utf-8") for i in indices]
        at = np.asarray(indices, dtype=np.int64)
        table = ClipTable.from_lists(self.root, relative, self.frames[at])
        if self.ranges is None:
            return table
        return replace(table, shards=self.shards, shard_of=self.shard_of[at], ranges=self.ranges[at], retry=self.retry)

    def path(self, i: int) -> str:
        rel = self.path_bytes[self.offsets[i] : self.offsets[i + 1]].tobytes().decode("utf-8")
        return os.path.join(self.root, rel)

    def clip(self, i: int) -> Clip:
        """Clip ``i`` as its decoder opens it: the path, or the member's bytes read from its
        shard now (a BadClipError when the shard cannot give them: counted and replaced
        like a missing file)."""
        if self.ranges is None:
            return self.path(i)
        offset, size = (int(v) for v in self.ranges[i])
        try:
            data = read_range(self.shards[self.shard_of[i]], offset, size, retry=self.retry)
        except ShardReadError as err:
            raise BadClipError(f"shard {err.kind}", err.detail) from err
        return ClipBytes(self.path(i), data)


def _index_or_error(url: str, retry: RetryPolicy) -> ShardIndex | ShardReadError:
    try:
        return load_index(url, retry)
    except ShardReadError as err:
        return err
