"""A broker connection that the broker reset fails as a lost connection, on uvloop as on asyncio.

The window is the few loop turns between the reset and aiokafka's read task noticing it: the test
holds it open by giving the connection no read task, and sends in it.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop
from aiokafka.conn import AIOKafkaConnection
from aiokafka.errors import KafkaConnectionError
from aiokafka.protocol.metadata import MetadataRequest

import transport.kafka  # noqa: F401  # guards the connections

METADATA_API = 3


def _reset_pair() -> tuple[socket.socket, socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))
    with listener:
        ours = socket.create_connection(listener.getsockname())
        broker, _ = listener.accept()
    return ours, broker


async def _send_after_reset() -> tuple[BaseException | None, bool]:
    ours, broker = _reset_pair()
    reader, writer = await asyncio.open_connection(sock=ours)
    conn = AIOKafkaConnection("127.0.0.1", ours.getpeername()[1])
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    done.set_result(None)
    conn._reader, conn._writer, conn._versions, conn._read_task = reader, writer, {METADATA_API: (0, 5)}, done
    broker.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    broker.close()  # a reset, as from a broker killed with -9
    with pytest.raises(ConnectionResetError):
        await reader.read()  # returns once the reset has landed
    assert writer.transport.is_closing()
    assert conn.connected(), "aiokafka still takes the connection for a live one"
    raised: BaseException | None = None
    try:
        conn.send(MetadataRequest([])).close()
    except Exception as err:  # what the send raises is the subject
        raised = err
    closed = conn._writer is None
    conn.close()
    return raised, closed


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_a_send_on_a_reset_connection_raises_a_retriable_connection_error_and_closes_it(
    run: Callable[[Coroutine[Any, Any, tuple[BaseException | None, bool]]], tuple[BaseException | None, bool]],
) -> None:
    raised, closed = run(_send_after_reset())
    assert isinstance(raised, KafkaConnectionError), f"{raised!r}: aiokafka's routines handle only KafkaError"
    assert raised.retriable
    assert closed, "the connection is closed, so the next request reconnects"
