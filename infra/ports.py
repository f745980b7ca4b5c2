"""Free loopback ports for services started by tests and the dev stack."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port that was free a moment ago.

    The OS picks it; the socket is closed before the service binds it, so a race with another
    process is possible (rare). Services retry with fresh ports when that happens.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port
