"""Where a run's tar shards lie and how their bytes are read, on local disk or behind any
fsspec URL (``s3://`` through s3fs, ``https://``, ``gs://``, ...).

A clip is one byte-range read of its shard, so this module owns the three things every reader
of a shard needs and that must not differ between them: how a shard list is spelled
(``expand_shards``), how a range is fetched with the transient faults of a network retried and
the permanent ones named (``read_range``, ``ShardReadError.kind``), and the one-line checks a
run makes before its first step (``source_errors``).
"""

from __future__ import annotations

import glob as local_glob
import importlib
import importlib.util
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, TypeVar
from urllib.parse import urlsplit

import braceexpand
import fsspec
from fsspec.core import split_protocol
from fsspec.spec import AbstractFileSystem

logger = logging.getLogger(__name__)

SHARD_SUFFIX = ".tar"
GLOB_CHARS = "*?["
LOCAL_PROTOCOLS = ("file", "local")
NO_GLOB_PROTOCOLS = ("http", "https")  # no listing API; "?" starts a query (a presigned URL)
FAULT_KINDS = ("missing", "denied", "no bucket", "unreachable", "truncated", "credentials")
# The AWS error codes that name a cause; anything else is judged by its HTTP status.
S3_CODE_KINDS = {
    "NoSuchKey": "missing",
    "NoSuchBucket": "no bucket",
    "InvalidAccessKeyId": "credentials",
    "SignatureDoesNotMatch": "credentials",
    "InvalidToken": "credentials",
    "ExpiredToken": "credentials",
    "TokenRefreshRequired": "credentials",
    "InvalidRange": "truncated",
    "AccessDenied": "denied",
    "AllAccessDisabled": "denied",
}
STATUS_KINDS = {404: "missing", 401: "denied", 403: "denied", 416: "truncated"}

T = TypeVar("T")


class ShardReadError(Exception):
    """A shard (or its bucket) cannot be read: ``kind`` is one of ``FAULT_KINDS`` so a run can
    count faults by cause, ``detail`` one line naming the URL and what the store said."""

    def __init__(self, kind: str, detail: str):
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown shard fault kind {kind!r}")
        detail = " ".join(detail.split())  # one line, whatever a client library's message held
        super().__init__(detail)
        self.kind, self.detail = kind, detail


@dataclass(frozen=True)
class RetryPolicy:
    """How often a transient fault is retried: ``attempts`` in all, waits doubling from
    ``first_wait_s``, never more than ``max_wait_s`` of waiting in all, so a dead store ends a
    read in bounded time (each attempt is itself bounded by the client's timeouts)."""

    attempts: int = 5
    first_wait_s: float = 0.5
    max_wait_s: float = 15.0

    def wait_s(self, retry: int) -> float:
        """The wait before retry number ``retry`` (1 for the first)."""
        return self.first_wait_s * 2 ** (retry - 1)


RETRY = RetryPolicy()
# Timeouts of one S3 request (seconds); a stalled connection is a transient fault, not a hang.
S3_CONNECT_TIMEOUT_S, S3_READ_TIMEOUT_S = 10, 60


class _ShortRead(Exception):
    """Fewer bytes arrived than the object holds: a dropped connection, worth a retry."""


# ---------------------------------------------------------------- spelling a shard list


def _entries(spec: str | Sequence[str]) -> list[str]:
    """The entries of a shard spec, braces expanded: a string splits on "::" as WebDataset's
    ``webdataset/shardlists.py:expand_urls`` splits its URL strings, then each entry expands
    its braces with ``braceexpand`` as that function does (a list's entries too)."""
    parts = spec.split("::") if isinstance(spec, str) else list(spec)
    return [url for part in parts if part for url in braceexpand.braceexpand(part)]


def _protocol(url: str) -> str:
    protocol, _ = split_protocol(url)
    return protocol or "file"


def _is_local_path(entry: str) -> bool:
    return "://" not in entry and _protocol(entry) == "file"


def _is_glob(entry: str) -> bool:
    return _protocol(entry) not in NO_GLOB_PROTOCOLS and any(c in entry for c in GLOB_CHARS)


def _names_a_shard(entry: str) -> bool:
    path = urlsplit(entry).path if _protocol(entry) in NO_GLOB_PROTOCOLS else entry
    return path.lower().endswith(SHARD_SUFFIX)


def is_shard_source(value: str | Sequence[str]) -> bool:
    """Whether a clip-source value (``data_root``, an annotation file) names tar shards rather
    than a folder or a JSON annotation file: some entry, braces expanded, ends in ".tar"."""
    if isinstance(value, str) and not value:
        return False
    return any(_names_a_shard(entry) for entry in _entries(value))


def expand_shards(spec: str | Sequence[str], *, retry: RetryPolicy = RETRY) -> list[str]:
    """The shard URLs or paths of ``spec``: a list or a "::"-separated string of entries, each
    brace-expanded, globs (``*``, ``?``, ``[``) matched on local disk or by the store's listing
    (sorted within a glob); order kept otherwise, a repeated shard once. A listing that fails
    raises ``ShardReadError``; a glob that matches nothing adds nothing (``source_errors``
    says so before a run)."""
    shards: dict[str, None] = {}
    for entry in _entries(spec):
        for shard in _glob(entry, retry) if _is_glob(entry) else [entry]:
            shards.setdefault(shard, None)
    return list(shards)


def _glob(pattern: str, retry: RetryPolicy) -> list[str]:
    if _is_local_path(pattern):
        return sorted(local_glob.glob(os.path.expanduser(pattern)))
    fs, path = _fs_and_path(pattern)

    def listing() -> list[str]:
        fs.invalidate_cache()  # a listing from before shards were added would be stale
        matches = fs.glob(path)
        if not matches and _protocol(pattern) not in LOCAL_PROTOCOLS:
            # A store's glob finds nothing in a bucket that is not there (or not ours to
            # list) as in an empty folder: listing the bucket itself tells them apart.
            fs.ls(path.split("/", 1)[0])
        return sorted(fs.unstrip_protocol(match) for match in matches)

    return _retrying(pattern, "listing", listing, retry)


# ---------------------------------------------------------------- filesystems


_filesystems: dict[tuple, AbstractFileSystem] = {}
_filesystems_pid = os.getpid()


def _filesystem(protocol: str) -> AbstractFileSystem:
    """One filesystem per protocol and process. A forked DataLoader worker must not use its
    parent's: fsspec drops its own instance cache in a child (``fsspec/spec.py``,
    ``_reset_instances_lock`` registered with ``os.register_at_fork``, and the pid check in
    ``_Cached.__call__``) and resets the event loop of async filesystems such as s3fs
    (``fsspec/asyn.py``, ``reset_after_fork``); an inherited instance refuses to run
    (``AsyncFileSystem.loop``: "This class is not fork-safe"). So this cache is dropped in a
    new process too. The key holds the AWS_* environment, which s3fs's client reads once."""
    global _filesystems_pid
    if os.getpid() != _filesystems_pid:
        _filesystems.clear()
        _filesystems_pid = os.getpid()
    key = (protocol, tuple(sorted(item for item in os.environ.items() if item[0].startswith("AWS_"))))
    if key not in _filesystems:
        _filesystems[key] = _new_filesystem(protocol)
    return _filesystems[key]


def _new_filesystem(protocol: str) -> AbstractFileSystem:
    if protocol != "s3":
        return fsspec.filesystem(protocol, skip_instance_cache=True)
    # One attempt per call in s3fs and in botocore: the retries here count and log each one.
    config = {
        "retries": {"total_max_attempts": 1},
        "connect_timeout": S3_CONNECT_TIMEOUT_S,
        "read_timeout": S3_READ_TIMEOUT_S,
    }
    fs = fsspec.filesystem("s3", skip_instance_cache=True, config_kwargs=config)
    fs.retries = 1  # s3fs's own loop (s3fs/core.py: _error_wrapper), a class attribute
    return fs


def _fs_and_path(url: str) -> tuple[AbstractFileSystem, str]:
    fs = _filesystem(_protocol(url))
    return fs, fs._strip_protocol(url)


# ---------------------------------------------------------------- faults


def _optional_classes(module: str, names: Sequence[str]) -> tuple[type, ...]:
    """Exception classes of an optional client library (none when it is not installed: its
    errors cannot occur then)."""
    try:
        found = importlib.import_module(module)
    except ImportError:
        return ()
    return tuple(getattr(found, name) for name in names)


def _transient_classes() -> tuple[type, ...]:
    """Network failures worth a retry: refused, reset or dropped connections, timeouts, a body
    cut short (aiohttp's payload error, botocore's streaming error, http.client's)."""
    import http.client

    return (
        ConnectionError,
        TimeoutError,
        http.client.IncompleteRead,
        _ShortRead,
        *_optional_classes("aiohttp", ["ClientConnectionError", "ClientPayloadError"]),
        *_optional_classes(
            "botocore.exceptions",
            [
                "EndpointConnectionError",
                "ConnectionClosedError",
                "ReadTimeoutError",
                "ConnectTimeoutError",
                "ResponseStreamingError",
            ],
        ),
    )


def _causes(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def _store_answer(exc: BaseException) -> tuple[str, int] | None:
    """The error code and HTTP status a store answered with, when ``exc`` carries one (a
    botocore ClientError, which s3fs keeps as the cause of what it raises; aiohttp's)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return str(response["Error"].get("Code", "")), int(status)
    if isinstance(exc, _optional_classes("aiohttp", ["ClientResponseError"])):
        return "", int(exc.status)
    return None


def _classify(exc: BaseException) -> tuple[str, bool, str] | None:
    """``(kind, transient, reason)`` of a failed request, or None for an exception that is no
    storage fault (a bug: raised as it is)."""
    chain = _causes(exc)
    no_credentials = _optional_classes("botocore.exceptions", ["NoCredentialsError", "PartialCredentialsError"])
    for cause in chain:
        answer = _store_answer(cause)
        if answer is not None:
            code, status = answer
            reason = f"{code or 'HTTP'} {status}".strip()
            if code in S3_CODE_KINDS:
                return S3_CODE_KINDS[code], False, reason
            if status >= 500 or code in ("SlowDown", "RequestTimeout"):
                return "unreachable", True, reason
            if status in STATUS_KINDS:
                return STATUS_KINDS[status], False, reason
        if no_credentials and isinstance(cause, no_credentials):
            return "credentials", False, str(cause)
    transient = _transient_classes()
    for cause in chain:
        if isinstance(cause, transient):
            return "unreachable", True, f"{type(cause).__name__}: {cause}".rstrip(": ")
    for cause in chain:
        if isinstance(cause, (FileNotFoundError, IsADirectoryError)):
            return "missing", False, "not found"
        if isinstance(cause, PermissionError):
            return "denied", False, f"permission denied: {cause}"
    return None


def _retrying(url: str, action: str, call: Callable[[], T], retry: RetryPolicy) -> T:
    """``call()``, its transient faults retried with doubling waits (each logged with its
    reason), then ``ShardReadError("unreachable")``; a permanent fault raises at once."""
    waited, attempt = 0.0, 0
    while True:
        attempt += 1
        try:
            return call()
        except ShardReadError:
            raise
        except Exception as exc:  # classified: a storage fault is named, anything else re-raised
            fault = _classify(exc)
            if fault is None:
                raise
            kind, transient, reason = fault
            if not transient:
                raise ShardReadError(kind, f"{url}: {action} failed: {reason}") from exc
            wait = min(retry.wait_s(attempt), retry.max_wait_s - waited)
            if attempt >= retry.attempts or wait <= 0:
                message = f"{url}: {action} failed after {attempt} attempts: {reason}"
                raise ShardReadError("unreachable", message) from exc
            logger.warning(
                "%s of %s failed (%s); retry %d of %d in %.1f s",
                action,
                url,
                reason,
                attempt,
                retry.attempts - 1,
                wait,
            )
            time.sleep(wait)
            waited += wait


# ---------------------------------------------------------------- reading


def read_range(url: str, start: int, size: int, *, retry: RetryPolicy = RETRY) -> bytes:
    """Exactly ``size`` bytes of ``url`` from byte ``start``: a clip's member in its shard.
    Transient faults are retried (``retry``); ``ShardReadError`` otherwise, "truncated" when
    the object ends before ``start + size``."""
    if start < 0 or size < 0:
        raise ValueError(f"a byte range starts and has a size at 0 or more, not {start} and {size}")
    if size == 0:
        return b""
    fs, path = _fs_and_path(url)

    def read() -> bytes:
        # Keywords: s3fs's second positional parameter of cat_file is version_id.
        data = fs.cat_file(path, start=start, end=start + size)
        if len(data) == size:
            return data
        total, _ = _stat(fs, url, path)
        if total < start + size:
            raise ShardReadError("truncated", f"{url}: ends at byte {total}, before the range {start}-{start + size}")
        raise _ShortRead(f"{len(data)} of {size} bytes arrived")

    return _retrying(url, f"reading bytes {start}-{start + size}", read, retry)


def read_shard(url: str, read: Callable[[IO[bytes]], T], *, block_size: int = 1 << 16, retry: RetryPolicy = RETRY) -> T:
    """``read(file)`` on a seekable file object over shard ``url`` that fetches ``block_size``
    bytes a request (hopping from tar header to tar header reads little of a shard), the
    whole read retried on a transient fault as ``read_range`` is."""
    fs, path = _fs_and_path(url)

    def attempt() -> T:
        with fs.open(path, "rb", block_size=block_size) as file:
            return read(file)

    return _retrying(url, "reading its tar headers", attempt, retry)


def _stat(fs: AbstractFileSystem, url: str, path: str) -> tuple[int, str]:
    info = fs.info(path)
    if info.get("type") == "directory":
        raise ShardReadError("missing", f"{url}: a folder, not a shard")
    version = next((info[key] for key in ("ETag", "etag", "mtime", "LastModified") if info.get(key)), "")
    return int(info["size"]), str(version)


def shard_stat(url: str, *, retry: RetryPolicy = RETRY) -> tuple[int, str]:
    """The shard's size in bytes and a version tag (its ETag, else its modification time) that
    changes when the shard is rewritten: what a cache of its index is keyed by."""
    fs, path = _fs_and_path(url)
    return _retrying(url, "stat", lambda: _stat(fs, url, path), retry)


# ---------------------------------------------------------------- before a run


def _aws_credentials_origin() -> str | None:
    """Where botocore finds AWS credentials (its provider's method, e.g. "env",
    "shared-credentials-file"), None when it finds none."""
    import botocore.session

    credentials = botocore.session.Session().get_credentials()
    return None if credentials is None else credentials.method


def _where_botocore_looked() -> str:
    """The places botocore's credential chain reads (``botocore/credentials.py``,
    ``create_credential_resolver``: the environment, then the profile's files, then the
    container and instance metadata), with this environment's values."""
    profile = os.environ.get("AWS_PROFILE", "default")
    credentials_file = os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")
    config_file = os.environ.get("AWS_CONFIG_FILE", "~/.aws/config")
    return (
        f"AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, profile {profile!r} (AWS_PROFILE) in {credentials_file} "
        f"(AWS_SHARED_CREDENTIALS_FILE) and {config_file} (AWS_CONFIG_FILE), container and instance metadata"
    )


FAULT_ADVICE = {
    "missing": "check the paths",
    "denied": "grant read access to the shards",
    "no bucket": "check the bucket's name and AWS_ENDPOINT_URL (the store it is in)",
    "unreachable": "check the network and the endpoint, then start again",
    "truncated": "the shard is shorter than listed: repack or re-upload it",
}


def _fault_line(kind: str, count: int, first: ShardReadError) -> str:
    what = "shard source" if count == 1 else f"{count} shard sources"
    if kind == "credentials":  # asked only here: botocore's chain may query instance metadata
        advice = (
            f"the store refused the credentials botocore took from {_aws_credentials_origin()}: "
            "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
        )
    else:
        advice = FAULT_ADVICE[kind]
    return f"{what} cannot be read ({kind}), first: {first.detail}; {advice}"


def source_errors(spec: str | Sequence[str], *, retry: RetryPolicy = RETRY) -> list[str]:
    """What stops a run from reading its shards, found before its first step: one line per
    cause (counted, not one per shard), each saying what to do. Empty when all is well."""
    entries = _entries(spec)
    lines: list[str] = []
    not_shards = [entry for entry in entries if not _names_a_shard(entry)]
    if not_shards:
        what = (
            "1 entry of the shard list is not a .tar shard"
            if len(not_shards) == 1
            else (f"{len(not_shards)} entries of the shard list are not .tar shards")
        )
        lines.append(
            f"{what}, first: {not_shards[0]}; "
            "list tar shards only (a folder or an annotation file is a source of its own)"
        )
    entries = [entry for entry in entries if _names_a_shard(entry)]
    if any(_protocol(entry) == "s3" for entry in entries):
        s3_line = _s3_client_line()
        if s3_line:
            lines.append(s3_line)
            entries = [entry for entry in entries if _protocol(entry) != "s3"]
    faults: dict[str, list[ShardReadError]] = {}
    unmatched: list[str] = []
    listed: list[str] = []
    for entry in entries:
        if not _is_glob(entry):
            listed.append(entry)
            continue
        try:
            if not _glob(entry, retry):
                unmatched.append(entry)
        except ShardReadError as error:  # counted by cause below
            faults.setdefault(error.kind, []).append(error)
    if unmatched:
        pattern = "pattern matches" if len(unmatched) == 1 else f"{len(unmatched)} patterns match"
        lines.append(f"the shard {pattern} no shard, first: {unmatched[0]}; check the pattern and where it points")
    for error in _listed_shard_faults(listed, retry):
        faults.setdefault(error.kind, []).append(error)
    lines += [_fault_line(kind, len(errors), errors[0]) for kind, errors in faults.items()]
    return lines


def _s3_client_line() -> str:
    """Why s3:// shards cannot even be asked for (s3fs missing, no credentials), else ""."""
    if importlib.util.find_spec("s3fs") is None:
        return "s3:// shards are read through s3fs, which is not installed: pip install s3fs"
    if _aws_credentials_origin() is None:
        return f"no AWS credentials for the s3:// shards: botocore looked at {_where_botocore_looked()}"
    return ""


def _listed_shard_faults(listed: list[str], retry: RetryPolicy) -> list[ShardReadError]:
    """The listed shards that are not there: local ones each checked, those in a store by one
    listing of each folder (one request per folder, not per shard); over HTTP, which lists
    nothing, the first shard of each host answers for its reachability."""
    faults: list[ShardReadError] = []
    by_folder: dict[str, list[str]] = {}
    for shard in listed:
        if _is_local_path(shard):
            if not os.path.isfile(os.path.expanduser(shard)):
                faults.append(ShardReadError("missing", f"{shard}: no such file"))
        else:
            by_folder.setdefault(shard.rsplit("/", 1)[0], []).append(shard)
    for folder, shards in by_folder.items():
        try:
            if _protocol(folder) in NO_GLOB_PROTOCOLS:
                shard_stat(shards[0], retry=retry)
                continue
            present = set(_glob(folder + "/*" + SHARD_SUFFIX, retry))
        except ShardReadError as error:  # counted by cause with the others
            faults.append(error)
            continue
        faults += [ShardReadError("missing", f"{shard}: no such object") for shard in shards if shard not in present]
    return faults
