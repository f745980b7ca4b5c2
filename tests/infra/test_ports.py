"""Free loopback ports: drawn below the kernel's ephemeral range, where outgoing connections do not
take them."""

from __future__ import annotations

import socket
from collections import deque
from pathlib import Path

import pytest

from infra import ports


def test_a_free_port_is_below_the_ephemeral_range_and_can_be_bound() -> None:
    low = ports.ephemeral_low()
    for _ in range(20):
        port = ports.free_port()
        assert max(1024, low - ports.BELOW_EPHEMERAL) <= port < low, f"{port} is not below {low}"
        with socket.socket() as sock:
            # As servers bind (Kafka, Redis, uvicorn): a connection of an earlier test's server left in
            # TIME_WAIT does not hold the port, a listener does
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((ports.LOOPBACK, port))  # raises if it was not free
            sock.listen(1)


def test_the_range_is_read_from_the_kernel_or_taken_as_linuxs_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t50000\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", ranges)
    assert ports.ephemeral_low() == 40000
    assert 28000 <= ports.free_port() < 40000
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "missing")
    assert ports.ephemeral_low() == 32768


def test_with_no_port_free_below_the_range_the_os_picks_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "port_is_free", lambda port, host=ports.LOOPBACK: False)
    port = ports.free_port()
    assert port > 0
    with socket.socket() as sock:
        sock.bind((ports.LOOPBACK, port))


def test_a_port_handed_out_lately_is_not_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stack draws every server's port before any binds: two draws of one port would collide."""
    ranges = iter([5000, 5000, 5001])
    monkeypatch.setattr(ports.random.SystemRandom, "randrange", lambda self, low, high: next(ranges))
    monkeypatch.setattr(ports, "_RECENT", deque(maxlen=8))
    monkeypatch.setattr(ports, "port_is_free", lambda port, host=ports.LOOPBACK: True)  # none binds in between
    assert [ports.free_port(), ports.free_port()] == [5000, 5001]
