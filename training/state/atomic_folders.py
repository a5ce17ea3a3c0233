"""Folders that every rank writes into and that appear complete or not at all.

A save (a checkpoint, ``best_model/``) is written into ``.tmp-<name>`` beside its final
place (``base.atomic.temporary_name``), made empty by the main process. A failure on any
rank is shared with all, so no rank waits in a collective for one that failed: every rank
raises, and the partial folder is removed. Otherwise the ranks share out the CRC-32s of
the files, the main process writes the manifest (``checkpoint.json``: every file with its
size and CRC-32) last and renames the folder into place. A folder counts only once its
manifest exists, so a crash at any moment leaves the previous state or the complete new one.

``training.state.checkpoints.save_checkpoint`` calls these steps in order; ``write_atomically``
runs them around one writing function (the best model).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

from taehv_train.base.atomic import atomic_write, fsync_directory, temporary_name
from taehv_train.base.errors import UserError, readable_size
from taehv_train.common.folder_locks import replacing
from taehv_train.common.run_files import CHECKPOINT_MANIFEST, file_checksum


class DiskFullError(UserError):
    """A save failed for lack of space; the previous checkpoints are untouched."""


_DISK_FULL_MESSAGES = ("No space left on device", "os error 28", "Disk quota exceeded", "unexpected pos")
_DISK_FULL = "disk full"


def is_disk_full(error: BaseException | None) -> bool:
    """``error``, or one it was raised from, says the disk or the quota is full: an OSError
    with ENOSPC/EDQUOT, or the same surfaced in a message by safetensors ("os error 28") or
    torch.save ("unexpected pos")."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(error) for text in _DISK_FULL_MESSAGES):
            return True
        error = error.__cause__ or error.__context__
    return False


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def _disk_full_message(final: Path, needed: int) -> str:
    """What was being saved where, how much it needs (the newest complete save beside it,
    else ``needed``, the estimate of the ranks' state) and how much is free."""
    previous = [p for p in final.parent.iterdir() if p.is_dir() and (p / CHECKPOINT_MANIFEST).is_file()]
    if previous:
        needed = _folder_bytes(max(previous, key=lambda p: p.stat().st_mtime))
    free = shutil.disk_usage(final.parent).free
    kept = [p.name for p in previous if p.name != final.name]
    return (
        f"no space left to save {final.name} in {final.parent}: it needs about {readable_size(needed)} and "
        f"{readable_size(free)} are free; "
        + (f"{', '.join(sorted(kept))} kept intact" if kept else "nothing was saved")
        + ". Free some space (or lower checkpoints_total_limit, or move output_dir)"
    )


def make_temporary_folder(accelerator: Accelerator, final: Path) -> Path:
    """``.tmp-<name>`` beside ``final``, emptied and created by the main process; every rank
    calls it and gets it once it exists."""
    tmp = temporary_name(final)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    return tmp


def failed_ranks(accelerator: Accelerator, failure: Exception | None) -> list[tuple[int, str]]:
    """(rank, what failed) for every rank whose write raised ``failure``: the same list on
    every rank (a gather: every rank calls it, failed or not)."""
    described = (
        None if failure is None else (_DISK_FULL if is_disk_full(failure) else f"{type(failure).__name__}: {failure}")
    )
    return [(rank, what) for rank, what in gather_object([(accelerator.process_index, described)]) if what is not None]


def ran_out_of_space(failed: list[tuple[int, str]]) -> bool:
    """Some rank of ``failed_ranks`` failed for a full disk or quota."""
    return any(what == _DISK_FULL for _, what in failed)


def abandon(
    accelerator: Accelerator,
    final: Path,
    tmp: Path,
    failure: Exception | None,
    failed: list[tuple[int, str]],
    share: int,
) -> NoReturn:
    """Stop a save that failed on some rank, on every rank, the partial folder removed: a
    full disk is a DiskFullError on every rank (``share``, this rank's bytes, summed over the
    ranks, says what the save needs when nothing was saved before); another error is raised
    where it happened and the other ranks say which rank failed."""
    message = _disk_full_message(final, sum(gather_object([share]))) if ran_out_of_space(failed) else None
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    if message is not None:
        raise DiskFullError(message) from failure
    if failure is not None:
        raise failure
    raise RuntimeError(f"{final.name} was not saved: " + "; ".join(f"rank {r} failed ({what})" for r, what in failed))


def checksum_files(accelerator: Accelerator, tmp: Path) -> dict[str, str]:
    """CRC-32 of every file in ``tmp``, the files shared out among the ranks (every rank calls it)."""
    names = [[p.relative_to(tmp).as_posix() for p in sorted(tmp.rglob("*")) if p.is_file()]]
    broadcast_object_list(names)  # the main process's listing is the one that counts
    mine = {
        name: file_checksum(tmp / name) for name in names[0][accelerator.process_index :: accelerator.num_processes]
    }
    return {name: crc for part in gather_object([mine]) for name, crc in part.items()}


def write_manifest(tmp: Path, info: dict[str, Any], checksums: dict[str, str], seconds: float) -> None:
    """``checkpoint.json`` in ``tmp``: ``info``, every file with its size and CRC-32, and the
    ``seconds`` the checksums took (main process only, after every other file)."""
    files = {name: {"size": (tmp / name).stat().st_size, "crc32": crc} for name, crc in sorted(checksums.items())}
    manifest = {**info, "files": files, "checksum_seconds": round(seconds, 4)}
    atomic_write(tmp / CHECKPOINT_MANIFEST, json.dumps(manifest, indent=1))


def rename_into_place(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final``, durably (main process only)."""
    with replacing(final):  # best_model/: after its readers have loaded it
        if final.exists():  # the previous one, or an incomplete leftover of the same name
            shutil.rmtree(final)
        os.replace(tmp, final)
    fsync_directory(final.parent)


def write_atomically(
    accelerator: Accelerator,
    final: Path,
    write: Callable[[Path], None],
    info: dict[str, Any],
    expected_bytes: Callable[[], int] = lambda: 0,
) -> Path:
    """The steps above around ``write(tmp)``, which every rank calls; ``expected_bytes()``
    (this rank's share of the save) is asked only when the disk is full."""
    tmp = make_temporary_folder(accelerator, final)
    failure = None
    try:
        write(tmp)
    except Exception as error:  # shared with the other ranks below, then raised
        failure = error
    if failed := failed_ranks(accelerator, failure):
        abandon(accelerator, final, tmp, failure, failed, expected_bytes() if ran_out_of_space(failed) else 0)
    start = time.perf_counter()
    checksums = checksum_files(accelerator, tmp)
    seconds = time.perf_counter() - start
    if accelerator.is_main_process:
        write_manifest(tmp, info, checksums, seconds)
        rename_into_place(tmp, final)
    accelerator.wait_for_everyone()
    return final
