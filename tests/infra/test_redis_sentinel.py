"""Asking a Redis or a Sentinel that does not answer costs one timeout, not redis-py's retries of it.

`stack up` asks every live Redis node its role and every Sentinel the primary; `stack status` does too.
A stopped or overloaded server accepts the connection and says nothing.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from infra.errors import ServiceStartError
from infra.redis_cluster import wait_whole
from infra.redis_sentinel import redis_role, sentinel_primary


@pytest.fixture
def silent_server() -> Iterator[tuple[int, list[socket.socket]]]:
    """A loopback port that accepts connections and never answers; the connections it accepted."""
    accepted: list[socket.socket] = []
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], accepted
    finally:
        stop.set()
        listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone does not
        listener.close()
        thread.join(5)
        for connection in accepted:
            connection.close()


@pytest.mark.parametrize("ask", [redis_role, lambda port: sentinel_primary([port])], ids=["role", "sentinel"])
def test_a_server_that_does_not_answer_is_asked_once(
    ask: Callable[[int], object], silent_server: tuple[int, list[socket.socket]]
) -> None:
    port, accepted = silent_server

    assert ask(port) is None

    assert len(accepted) == 1, f"one connection, one question; {len(accepted)} were made"


def test_a_cluster_node_that_does_not_answer_is_asked_once_per_look(
    silent_server: tuple[int, list[socket.socket]],
) -> None:
    port, accepted = silent_server

    with pytest.raises(ServiceStartError, match="does not serve every slot"):
        wait_whole([port], 0, deadline=time.monotonic())  # one look, then the deadline has passed

    assert len(accepted) == 1, f"one connection, one question; {len(accepted)} were made"
