"""Own videos in one step: what ``./train_taehv_h100.sh N PRESET --data=DIR`` runs first.

It annotates DIR with ``training.make_annotations`` (probing only files it has not seen:
a re-run over a grown folder costs only the new clips) into
``<output_dir>/annotations/<folder>-<hash>/annotations_{train,val}.json``, split by
make_annotations' rule (about ``--val_fraction`` 0.1 of the clips held out, whole source
groups together; clip by clip when no group fits that share: one source, or a few large
ones such as two camera folders), and writes the overrides that
train on them, one per line, for the launch script. With one clip it trains without a
validation set and says so. A DIR (or URL) holding the shards ``make_annotations
--to_shards`` packs (``train/*.tar``, ``val/*.tar``) is trained on as it is: nothing to annotate.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from taehv_train.base.atomic import atomic_write
from taehv_train.base.errors import UserError
from taehv_train.base.flags import ArgumentParser
from taehv_train.common.annotation_file import read_annotation
from taehv_train.common.config import load_config, resolve_source
from taehv_train.common.shard_source import is_shard_source, source_errors
from taehv_train.common.video.files import clip_extensions, holds_clips
from taehv_train.training import make_annotations
from taehv_train.training.annotate.annotation_files import output_paths
from taehv_train.training.annotate.annotation_split import Split, split_problem


def annotation_file(output_dir: str | Path, folder: Path) -> Path:
    """Where ``folder``'s annotations go: one place per folder (its name and a hash of its
    absolute path), so that a re-run finds its probe records and runs share one split."""
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:8]
    return Path(output_dir) / "annotations" / f"{folder.resolve().name}-{digest}" / "annotations.json"


def shard_overrides(place: str) -> list[str] | None:
    """The overrides that train on the shards ``make_annotations --to_shards`` wrote to
    ``place`` (a folder or a URL prefix: ``train/*.tar`` and ``val/*.tar`` under it), or that
    ``place`` names itself (a glob, a brace pattern: no validation set); None when ``place``
    holds no shards (a folder of videos)."""
    if is_shard_source(place):
        print(f"note: --data {place} names shards alone: training without validation")
        return [f"--data_root={resolve_source(place)}", "--annotation_file=", "--val_annotation_file="]
    base = place.rstrip("/") if "://" in place else str(Path(place).resolve())
    train, val = f"{base}/train/*.tar", f"{base}/val/*.tar"
    if "://" not in place and not any(Path(base, "train").glob("*.tar")):
        return None
    if errors := source_errors(train):
        raise UserError(f"--data {place}: {errors[0]}")
    if source_errors(val):
        print(f"note: --data {place} has no val/ shards: training without validation")
        val = ""
    return [f"--data_root={train}", "--annotation_file=", f"--val_annotation_file={val}"]


def annotate(folder: Path, output_dir: str | Path) -> list[str]:
    """Annotate ``folder`` and return the overrides that train on it; UserError when it holds
    no clip or none is usable."""
    if not folder.is_dir():
        raise UserError(f"--data {folder} is not a folder")
    if not holds_clips(folder):
        raise UserError(f"--data {folder} holds no videos or images ({', '.join(clip_extensions(images=True))})")
    out = annotation_file(output_dir, folder)
    paths = output_paths(out)
    # the launch script goes on to train on them: the tool's own "train on them" line is left out
    status = make_annotations.main([str(folder), "-o", str(out), *recorded_split(paths)], train_line=False)
    kept = clip_counts(paths)
    if status != 0 and kept["train"] > 1 and not kept["val"]:  # no source group fits the share: clip by clip
        print(f"note: {why_nothing_held_out(paths)}: validation clips are held out file by file (--group_regex '')")
        status = make_annotations.main([str(folder), "-o", str(out), "--group_regex", ""], train_line=False)
        kept = clip_counts(paths)
    if not kept["train"]:
        raise UserError(f"--data {folder}: no usable clips (the reasons are in {paths['skipped']})")
    overrides = [f"--data_root={folder.resolve()}", f"--annotation_file={paths['train']}"]
    if kept["val"]:
        return [*overrides, f"--val_annotation_file={paths['val']}"]
    print(f"note: no clip of {folder} could be held out for validation (one clip): training without validation")
    return [*overrides, "--val_annotation_file="]


def why_nothing_held_out(paths: dict[str, Path]) -> str:
    """Why the split the train file records held no clip out: one source group, or groups
    each larger than the share held out (``split_problem``'s words)."""
    train = read_annotation(paths["train"])
    clips = [entry["path"] for entry in train["list"]]
    message, _ = split_problem(clips, Split(**train["split"]), 0)
    return message


def recorded_split(paths: dict[str, Path]) -> list[str]:
    """The split flags this folder's files were written with (a re-run keeps their split),
    none before its first run."""
    split = read_annotation(paths["val"]).get("split") if paths["val"].is_file() else None
    if not split:
        return []
    return [
        "--val_fraction",
        str(split["val_fraction"]),
        "--seed",
        str(split["seed"]),
        "--group_regex",
        split["group_regex"],
    ]


def clip_counts(paths: dict[str, Path]) -> dict[str, int]:
    """How many clips make_annotations wrote into the train and val files."""
    return {part: len(read_annotation(paths[part])["list"]) for part in ("train", "val")}


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description="Annotate a folder of clips for the launch script's --data.")
    parser.add_argument("folder", help="a folder of videos, or shards: a folder or URL with train/ and val/ shards")
    parser.add_argument("--config", required=True, help="the run's config file (for output_dir)")
    parser.add_argument("--overrides_file", type=Path, required=True, help="where the training overrides go")
    args, overrides = parser.parse_known_args(argv)
    config = load_config(args.config, [o for o in overrides if o.startswith("--output_dir=")])
    data = shard_overrides(args.folder)
    if data is None:
        data = annotate(Path(args.folder), config.output_dir)
    atomic_write(args.overrides_file, "\n".join(data) + "\n")


if __name__ == "__main__":
    from taehv_train.base.errors import exit_on_user_error

    exit_on_user_error(main)
