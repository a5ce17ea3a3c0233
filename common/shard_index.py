"""Where each clip lies inside a tar shard: the member table a run reads clips by.

A shard is a tar file in the layout WebDataset and video2dataset write: members grouped by
key (the member name up to the first "." of its base name), ``{key}.mp4`` (or another video
extension) beside ``{key}.json``. A clip is read by one byte-range request for its video
member, so a run needs, per shard, each video member's offset and size, and its frame count
and size when known: the ``ShardIndex``. Shards that ``make_annotations --to_shards`` packs
carry it beside them as ``<shard>.index.json`` (the sidecar), with each clip's probe.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

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
