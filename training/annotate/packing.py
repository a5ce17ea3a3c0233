"""``--to_shards``: where the kept clips are packed (checked before anything is probed),
packing them, and what was packed."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from taehv_train.base.errors import UserError
from taehv_train.common.shard_writer import DEFAULT_SHARD_SIZE, Packed, ShardFolder, pack, parse_size, part_prefix
from taehv_train.training.annotate.annotation_files import Annotated
from taehv_train.training.annotate.annotation_split import count
from taehv_train.training.annotate.commands import shard_train_command


@dataclass(frozen=True)
class Packing:
    """Where ``--to_shards`` packs, checked before anything is probed."""

    out: str  # a URL, or a local folder made absolute
    shard_size: int
    part: tuple[int, int] | None  # --shard K/N
    output: Path  # -o, the annotation and probe files


def packing_plan(
    out: str, shard_size: str | None, output: Path | None, part: tuple[int, int] | None, merge: bool
) -> Packing:
    """The settings of ``--to_shards``; a UserError when they cannot work (a malformed
    size, an OUT that cannot be written or whose storage has no fsspec filesystem here)."""
    if merge:
        raise UserError("--to_shards packs each --shard part on its own: there is nothing to --merge")
    size = parse_size(shard_size or DEFAULT_SHARD_SIZE)
    try:
        folder = ShardFolder(out)
    except (ImportError, ValueError) as err:  # no s3fs for s3://, an unknown protocol
        raise UserError(f"--to_shards {out}: {err}") from None
    if folder.local:
        out = str(Path(folder.path).absolute())
    elif output is None:
        raise UserError(f"--to_shards {out}: name a local -o for the annotation and probe files")
    try:
        folder.check_writable()
    except OSError as err:  # a read-only folder, a bucket that does not exist, credentials that may not write
        raise UserError(f"--to_shards {out}: cannot write there: {err.strerror or err}") from None
    output = output if output is not None else Path(out) / "annotations.json"
    if part is not None:  # each part's own files, beside the others'
        output = output.with_name(f"{output.stem}_{part_prefix(part)[:-1]}{output.suffix}")
    return Packing(out, size, part, output)


def pack_clips(annotated: Annotated, packing: Packing) -> dict[str, Packed]:
    """Pack the annotated clips into shards under ``packing.out``, per side of the split; a
    UserError when a write fails (the finished shards are kept)."""
    try:
        return pack(
            annotated.root,
            {"train": annotated.train, "val": annotated.val},
            packing.out,
            packing.shard_size,
            packing.part,
        )
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: the finished shards under {packing.out} are kept (a shard without its sidecar is "
            "not); the same command continues",
            file=sys.stderr,
        )
        raise
    except OSError as err:  # no space, no permission, a bucket that does not exist, a clip gone since its probe
        raise UserError(
            f"cannot pack into {packing.out}: {err.strerror or err}; the finished shards there are kept and the "
            "same command continues"
        ) from None


def print_packed(packed: dict[str, Packed], packing: Packing, train_line: bool) -> None:
    """Say what was packed where (and which unfinished shards were packed again); with
    ``train_line``, the command that trains on the shards."""
    if removed := [f"{done.url}/{name}" for done in packed.values() for name in done.removed]:
        print(
            f"removed {count(len(removed), 'unfinished shard')} (no index: a stopped run's), their clips packed "
            f"again: {', '.join(removed)}"
        )
    for side, done in packed.items():
        print(
            f"{side}: packed {count(done.new_clips, 'clip')} into {count(len(done.new_shards), 'new shard')}; "
            f"{done.url} holds {count(done.clips, 'clip')} in {count(done.shards, 'shard')}"
        )
    if train_line:
        when = f"once all {packing.part[1]} parts are packed, " if packing.part else ""
        print(f"{when}train on them: {shard_train_command(packing.out, bool(packed['val'].clips))}")
