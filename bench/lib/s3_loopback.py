"""A real S3 API on loopback for the tests and benchmarks, and a proxy in front of it that breaks connections.

``MotoServer`` runs moto's server (``python -m moto.server``) in a subprocess, so its threads
stay out of the test process and of the training runs the tests start; the client code under
test (s3fs, botocore, aiohttp) talks HTTP to it as to any S3-compatible store, found through
``AWS_ENDPOINT_URL``, which botocore reads. With ``auth=True`` moto checks the request
signatures against its IAM users (moto's ``INITIAL_NO_AUTH_ACTION_COUNT`` setting,
``moto/settings.py``: unset, moto accepts any keys; ``0``, it authenticates every request), so
made-up keys get the real 403 a store answers them with.

``FaultProxy`` forwards TCP bytes between a client and the server and, on command, cuts the
next responses after some bytes of their body (a connection dropped mid-shard) or stops
listening (the store is down: connections are refused).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from taehv_train.base.ports import free_port

START_TIMEOUT_S = 60
REGION = "us-east-1"
FAKE_KEYS = {"AWS_ACCESS_KEY_ID": "testing-key", "AWS_SECRET_ACCESS_KEY": "testing-secret"}


def _wait_listening(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto's server exited with status {process.returncode} before it listened")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto's server did not listen on port {port} within {START_TIMEOUT_S} s")


def client_environment(endpoint: str, home: Path, keys: dict[str, str] | None = None) -> dict[str, str]:
    """The environment an S3 client of ``endpoint`` runs in: the store's address, fake keys
    (``keys``: others, or none at all), and the developer's own ~/.aws and instance metadata
    out of reach, so nothing but these variables can supply credentials."""
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-credentials"),
        "AWS_CONFIG_FILE": str(home / "no-config"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    env.update(FAKE_KEYS if keys is None else keys)
    return env


CLEARED_VARIABLES = (
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL_S3",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
)  # what else would change where botocore looks or what it finds


class MotoServer:
    """moto's S3 server in a subprocess on a free loopback port."""

    def __init__(self, home: Path, *, auth: bool = False):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, **client_environment(self.endpoint, home)}
        if auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        self.log = home / f"moto-{self.port}.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        try:
            _wait_listening(self.port, self.process)
        except RuntimeError:
            self.stop()
            raise

    def client(self, keys: dict[str, str] | None = None):
        """A boto3 S3 client of this server, to set up buckets and objects."""
        import boto3

        keys = FAKE_KEYS if keys is None else keys
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
        )

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class FaultProxy:
    """TCP on loopback between clients and ``upstream_port``: bytes pass through unchanged
    until ``drop_responses`` or ``go_down`` says otherwise."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._drops_left, self._body_bytes = 0, 0
        self.dropped = 0  # responses cut so far
        self._connections: set[_Connection] = set()
        self._listener: socket.socket | None = None
        self.go_up()

    def drop_responses(self, count: int, after_body_bytes: int) -> None:
        """Cut the next ``count`` responses after ``after_body_bytes`` bytes of their body (the
        headers pass whole, so the client sees a body end before its Content-Length); a body
        no longer than that passes whole."""
        with self._lock:
            self._drops_left, self._body_bytes, self.dropped = count, after_body_bytes, 0

    def go_down(self) -> None:
        """Stop listening and end the open connections: new ones are refused and pooled ones
        fail, as with a store that is down."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread and stops listening
            listener.close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            connection.close()

    def go_up(self) -> None:
        """Listen (again) on the proxy's port."""
        if self._listener is not None:
            return
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # the listener was closed: go_down
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            connection = _Connection(self, client, upstream)
            with self._lock:
                self._connections.add(connection)
            threading.Thread(target=connection.requests, daemon=True).start()
            threading.Thread(target=connection.responses, daemon=True).start()

    def _forget(self, connection: _Connection) -> None:
        with self._lock:
            self._connections.discard(connection)

    def _take_drop(self) -> int | None:
        """The body bytes after which the response to a new request is cut, None to pass it."""
        with self._lock:
            if self._drops_left == 0:
                return None
            self._drops_left -= 1
            self.dropped += 1
            return self._body_bytes


class _Connection:
    """One client connection and its upstream one; a request may doom its response."""

    def __init__(self, proxy: FaultProxy, client: socket.socket, upstream: socket.socket):
        self.proxy, self.client, self.upstream = proxy, client, upstream
        self.cut_after: int | None = None  # body bytes to pass before the cut, for this response
        self.in_request = False

    def close(self) -> None:
        self.proxy._forget(self)
        for end in (self.client, self.upstream):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed by the other side
                pass
            end.close()

    def requests(self) -> None:
        while chunk := self._receive(self.client):
            if not self.in_request:  # the first bytes of a new request
                self.in_request = True
                self.cut_after = self.proxy._take_drop()
            self.upstream.sendall(chunk)

    def responses(self) -> None:
        head, body_seen = b"", None  # body_seen: bytes of body passed once the headers ended
        while chunk := self._receive(self.upstream):
            self.in_request = False
            if self.cut_after is None:
                self.client.sendall(chunk)
                continue
            if body_seen is None:
                head += chunk
                end = head.find(b"\r\n\r\n")
                if end < 0:
                    self.client.sendall(chunk)
                    continue
                body_seen, chunk = 0, head[end + 4 :]
                self.client.sendall(head[: end + 4])
            passed = chunk[: max(0, self.cut_after - body_seen)]
            self.client.sendall(passed)
            body_seen += len(passed)
            if body_seen >= self.cut_after:
                self.close()
                return
        self.close()

    @staticmethod
    def _receive(end: socket.socket) -> bytes:
        try:
            return end.recv(65536)
        except OSError:  # the connection was closed: the pump ends
            return b""


class S3Bucket:
    """A fresh bucket of the test's server, and what the test's client environment holds."""

    def __init__(self, server: MotoServer, name: str, environment: dict[str, str]):
        self.server, self.name, self.environment = server, name, environment
        self.client = server.client()
        self.client.create_bucket(Bucket=name)

    def url(self, key: str) -> str:
        return f"s3://{self.name}/{key}"

    def put(self, key: str, data: bytes) -> str:
        """Store ``data`` as ``key``; its s3:// URL."""
        self.client.put_object(Bucket=self.name, Key=key, Body=data)
        return self.url(key)
