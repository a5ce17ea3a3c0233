"""A free TCP port on this machine, for a job whose processes meet on one node.

Two jobs on one machine (two users, two runs, a test suite running in parallel) must not
ask for the same rendezvous port: a fixed default (29500) makes the second one fail with
"address already in use". The kernel hands out an unused port for a bind to port 0, as
``torchrun --standalone`` does; the port is released before the job binds it, so another
process could take it in between, which on a single node is rare enough to accept.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no process is listening on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
