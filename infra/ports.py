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


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether a server could listen on `host:port` now (binding as Kafka and Redis do, with
    SO_REUSEADDR, so connections of a server that just died do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError:
            return False
        return True
