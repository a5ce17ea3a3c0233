"""Where each clip lies inside a tar shard: the member table a run reads clips by.

A shard is a tar file in the layout WebDataset and video2dataset write: members grouped by
key (the member name up to the first "." of its base name), ``{key}.mp4`` (or another video
extension) beside ``{key}.json``. A clip is read by one byte-range request for its video
member, so a run needs, per shard, each video member's offset and size, and its frame count
and size when known: the ``ShardIndex``. Shards that ``make_annotations --to_shards`` packs
carry it beside them as ``<shard>.index.json`` (the sidecar), with each clip's probe.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import posixpath
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from taehv_train.base.atomic import atomic_write
from taehv_train.common.shard_source import RETRY, RetryPolicy, ShardReadError, read_range, read_shard, shard_stat
from taehv_train.common.video.files import BadClipError, ClipBytes, clip_extensions
from taehv_train.common.video.probe import probe_video

logger = logging.getLogger(__name__)

INDEX_SUFFIX = ".index.json"  # 00000.tar -> 00000.tar.index.json
INDEX_FORMAT = "taehv-shard-index/1"


@dataclass(frozen=True)
class ShardMember:
    """One clip in a shard: its video member and what its probe found (-1 / 0.0 / "" unknown)."""

    key: str  # the sample key, shared by the video member and its JSON
    name: str  # the video member's name in the tar, e.g. "000000123.mp4"
    offset: int  # byte offset of the member's data in the shard
    size: int  # bytes of the member's data
    frames: int = -1  # frames that decode
    width: int = -1
    height: int = -1
    fps: float = 0.0
    path: str = ""  # where the clip came from (the packed folder's relative path)


@dataclass(frozen=True)
class ShardIndex:
    """The clips of one shard, in the order they lie in it, and the shard's size when indexed."""

    url: str
    shard_bytes: int
    members: tuple[ShardMember, ...]


def sidecar_url(shard_url: str) -> str:
    """Where the index of ``shard_url`` lies beside it."""
    return shard_url + INDEX_SUFFIX


def index_text(index: ShardIndex) -> str:
    """The sidecar's JSON text (the shard's own URL is not written: the sidecar moves with it)."""
    members = [asdict(member) for member in index.members]
    return json.dumps({"format": INDEX_FORMAT, "shard_bytes": index.shard_bytes, "members": members}, indent=0) + "\n"


def index_from_text(url: str, text: str) -> ShardIndex:
    """The index of shard ``url`` from its sidecar text; ValueError naming what is wrong."""
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT:
        raise ValueError(f"{sidecar_url(url)} is not a shard index of format {INDEX_FORMAT!r}")
    members = tuple(ShardMember(**member) for member in data["members"])
    return ShardIndex(url, int(data["shard_bytes"]), members)


def cache_dir() -> Path:
    """Where indexes built from shards' tar headers are remembered on this machine:
    ``TAEHV_SHARD_INDEX_CACHE``, else ``$XDG_CACHE_HOME/taehv_train/shard_index``."""
    if folder := os.environ.get("TAEHV_SHARD_INDEX_CACHE"):
        return Path(folder)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "taehv_train" / "shard_index"


def load_index(url: str, retry: RetryPolicy = RETRY) -> ShardIndex:
    """The index of shard ``url``: its sidecar, else the one this machine built from the
    shard before (same size and version), else built now from its tar headers and
    remembered. A sidecar that is damaged or of another size of the shard (re-packed, cut
    short) is passed over, with a warning. Raises ShardReadError when the shard cannot be read."""
    shard_bytes, version = shard_stat(url, retry=retry)
    sidecar = sidecar_url(url)
    try:
        text = read_range(sidecar, 0, shard_stat(sidecar, retry=retry)[0], retry=retry)
    except ShardReadError as err:
        if err.kind != "missing":
            raise
    else:
        if (index := _readable_index(url, text, shard_bytes, sidecar)) is not None:
            return index
    remembered = cache_dir() / (hashlib.sha256(f"{url}\n{shard_bytes}\n{version}".encode()).hexdigest() + ".json")
    remembered.parent.mkdir(parents=True, exist_ok=True)
    # one process of this machine builds it (the training processes start together), the others wait and read it
    with open(remembered.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if remembered.is_file() and (index := _readable_index(url, remembered.read_bytes(), shard_bytes, remembered)):
            return index
        index = build_index(url, shard_bytes, retry)
        atomic_write(remembered, index_text(index))
    return index


def _readable_index(url: str, text: bytes, shard_bytes: int, where: str | Path) -> ShardIndex | None:
    """The index in ``text`` (read from ``where``) when it is whole and of a shard of
    ``shard_bytes`` bytes; else None, with a warning saying why."""
    try:
        index = index_from_text(url, text.decode("utf-8"))
    except (ValueError, TypeError, KeyError) as err:  # not JSON, another format, entries of other fields
        logger.warning("the shard index %s is damaged (%s): indexing %s from its tar headers", where, err, url)
        return None
    if index.shard_bytes != shard_bytes:
        logger.warning(
            "the shard index %s is of a shard of %d bytes, %s has %d: indexing it from its tar headers",
            where,
            index.shard_bytes,
            url,
            shard_bytes,
        )
        return None
    return index


def build_index(url: str, shard_bytes: int, retry: RetryPolicy = RETRY) -> ShardIndex:
    """The index of shard ``url`` from its tar headers (hopping from header to header, the
    clips' bytes unread) and each key's JSON member; a clip whose JSON states no frame count
    (video2dataset's, a foreign packer's) is read once and probed. A shard cut short keeps
    the members that lie whole in it; a member that does not decode is left out (logged)."""
    clips, probes = read_shard(url, lambda file: _tar_members(url, file, shard_bytes), retry=retry)
    members = []
    for key, clip in clips.items():
        stated = probes.get(key, {})
        if stated.get("frames", -1) < 1:
            data = read_range(url, clip["offset"], clip["size"], retry=retry)
            try:
                found = probe_video(ClipBytes(f"{url}#{clip['name']}", data))
            except BadClipError as err:
                logger.warning("shard %s: %s left out: %s", url, clip["name"], err)
                continue
            stated = stated | dict(frames=found.frames, width=found.width, height=found.height, fps=found.fps)
        members.append(ShardMember(**(clip | stated)))
    logger.info("indexed shard %s: %d clips", url, len(members))
    return ShardIndex(url, shard_bytes, tuple(members))


def _tar_members(url: str, file: IO[bytes], shard_bytes: int) -> tuple[dict[str, dict], dict[str, dict]]:
    """Per key, its first clip member's name, offset and size, and what its JSON member
    states; up to the first member that does not lie whole in the shard."""
    clips: dict[str, dict] = {}
    probes: dict[str, dict] = {}
    try:
        with tarfile.open(fileobj=file, mode="r:") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                if info.offset_data + info.size > shard_bytes:
                    raise tarfile.ReadError(f"{info.name} runs past the shard's {shard_bytes} bytes")
                directory, (key, _, extension) = (
                    posixpath.dirname(info.name),
                    posixpath.basename(info.name).partition("."),
                )
                key = posixpath.join(directory, key)
                if f".{extension.lower()}" in clip_extensions(images=True) and key not in clips:
                    clips[key] = dict(key=key, name=info.name, offset=info.offset_data, size=info.size)
                elif extension.lower() == "json":
                    probes[key] = _probe_fields(tar.extractfile(info).read())
    except (tarfile.ReadError, EOFError) as err:
        logger.warning("shard %s ends inside a member (%s): indexing the clips that lie whole in it", url, err)
    return clips, probes


def _probe_fields(text: bytes) -> dict:
    """What a clip's JSON member states of its probe: frames, width, height, fps, path
    (the fields of the right type; others ignored)."""
    try:
        data = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    if not isinstance(data, dict):
        return {}
    kinds = dict(frames=int, width=int, height=int, fps=(int, float), path=str)
    return {
        name: data[name]
        for name, kind in kinds.items()
        if isinstance(data.get(name), kind) and not isinstance(data.get(name), bool)
    }
