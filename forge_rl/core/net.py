"""A free TCP port on this host (servers on loopback, torch.distributed rendezvous, tests)."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port free on `host` ("" : every address of this host) now; another process may take it after."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
