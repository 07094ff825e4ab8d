"""Small networking helpers shared by the rollout server, the launchers and the tests. Standard library only."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (the OS picks it for a bind to port 0).

    Another process may take it before the caller binds it; callers that start a server on it should fail clearly
    if the bind then fails."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
