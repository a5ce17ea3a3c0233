"""The command line of ``make_annotations``: its flags, and the checks that argparse reports
(exit status 2) before anything is read."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from pathlib import Path

from taehv_train.base.flags import ArgumentParser
from taehv_train.common.shard_writer import DEFAULT_SHARD_SIZE
from taehv_train.common.video.files import IMAGE_EXTENSIONS
from taehv_train.training.annotate.annotation_split import DEFAULT_GROUP_REGEX
from taehv_train.training.annotate.probe_pool import DEFAULT_PROBE_TIMEOUT


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def make_parser(description: str) -> ArgumentParser:
    """The tool's flags; ``description`` is its help text (the tool's docstring)."""
    parser = ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help="folder scanned recursively for videos")
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        help="names the files: -o X.json writes X_train.json, X_val.json, X_skipped.json and X_probes.jsonl "
        "(with a local --to_shards OUT: OUT/annotations.json by default)",
    )
    parser.add_argument(
        "--to_shards",
        metavar="OUT",
        help="also pack the kept clips into tar shards (WebDataset layout) under OUT/train and OUT/val: "
        "a folder or an fsspec URL such as s3://bucket/prefix",
    )
    parser.add_argument(
        "--shard_size",
        help=f"with --to_shards, the most bytes per shard: 1GB, 500MB, 1GiB or bytes (default: {DEFAULT_SHARD_SIZE})",
    )
    parser.add_argument("--val_fraction", type=float, default=0.1, help="share of clips for validation")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    parser.add_argument(
        "--group_regex",
        default=DEFAULT_GROUP_REGEX,
        help="first match on the relative path = source group kept on one side ('' = no grouping)",
    )
    parser.add_argument(
        "--resplit",
        action="store_true",
        help="split anew when the files next to -o hold a split made with other --val_fraction, --seed or "
        "--group_regex (held-out clips may then move into the training set of runs that use them)",
    )
    parser.add_argument(
        "--min_frames", type=positive_int, default=1, help="skip clips with fewer decodable frames (default: 1)"
    )
    parser.add_argument("--workers", type=positive_int, default=1, help="probing processes (default: 1)")
    parser.add_argument(
        "--probe_timeout",
        type=positive_seconds,
        default=DEFAULT_PROBE_TIMEOUT,
        help="seconds one file may take to probe; its worker is then killed and the file skipped "
        "(default: %(default)g; raise it for videos of hours)",
    )
    parser.add_argument(
        "--images",
        action="store_true",
        help=f"annotate still images ({' '.join(IMAGE_EXTENSIONS)}) too, as one-frame clips "
        "(automatic when DIR holds no videos)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace annotation files that no records file of this DIR accounts for, and start over "
        "a records file of another DIR",
    )
    sharding = parser.add_mutually_exclusive_group()
    sharding.add_argument(
        "--shard",
        metavar="K/N",
        help="probe only part K of N (by a hash of the path) and write only its records, for --merge; "
        "with --to_shards, annotate and pack part K of N (by a hash of the source group), no merge",
    )
    sharding.add_argument(
        "--merge", action="store_true", help="write the annotation files from the N parts of --shard runs (no probing)"
    )
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """The flags of ``argv``; a flag out of range or a DIR that is no folder ends in argparse's
    usage error (exit status 2)."""
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        parser.error(f"{args.directory} is not a folder")
    if not 0 <= args.val_fraction < 1:
        parser.error("--val_fraction must be in [0, 1)")
    try:
        re.compile(args.group_regex)
    except re.error as err:
        parser.error(f"--group_regex {args.group_regex!r} is not a regular expression: {err}")
    return args
