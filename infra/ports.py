"""Free loopback ports for services started by tests and the dev stack."""

from __future__ import annotations

import random
import socket
from collections import deque
from pathlib import Path

LOOPBACK = "127.0.0.1"
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
BELOW_EPHEMERAL = 12_000
"""How many ports under the kernel's ephemeral range ``free_port`` draws from."""
_RECENT: deque[int] = deque(maxlen=256)
"""Ports handed out lately: a stack draws all of its ports before its servers bind them."""


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port that was free a moment ago, drawn from below the kernel's ephemeral range.

    The socket is closed before the service binds the port, so another process may take it first.
    Ports the OS picks (bind to 0) come from the ephemeral range, where every outgoing connection
    (a Kafka client's, a Redis client's) also takes its local port: on a busy machine one did, and a
    gateway found its port taken. Below that range only another listener can; where no port there is
    free, the OS picks one. A port handed out lately by this process is not handed out again.
    """
    low = ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(64):
        port = draw.randrange(max(1024, low - BELOW_EPHEMERAL), low)
        if port not in _RECENT and port_is_free(port, host):
            _RECENT.append(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        chosen: int = sock.getsockname()[1]
        return chosen


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default, 32768, where it is not readable)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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


def free_port_pair(offset: int, host: str = LOOPBACK) -> int:
    """A port ``free_port`` gives whose companion ``port - offset`` is free too (and above 1024): a Redis
    Cluster node's bus port, which Redis would otherwise put 10,000 above it, in the ephemeral range."""
    for _ in range(64):
        port = free_port(host)
        if port - offset > 1024 and port - offset not in _RECENT and port_is_free(port - offset, host):
            _RECENT.append(port - offset)
            return port
    raise OSError(f"no free pair of loopback ports {offset} apart")
