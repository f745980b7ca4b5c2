"""aiokafka's broker connection, made to fail as a lost connection when the broker reset it, and bounded
in how long it waits for a broker that answers nothing (``bound_requests``).

Every role runs on uvloop. When a broker dies (``kill -9``, a crash, a reboot) the kernel resets
its connections, and for the few loop turns before aiokafka's read task notices, the connection
still reads as connected while uvloop's transport refuses writes with ``RuntimeError``. aiokafka
catches only ``OSError`` there, so the error escapes into whichever of its background routines
was sending (group coordination, heartbeat, fetcher, the producer's sender), which ends for good:
the process's consumer or producer stays broken until the process restarts. Under asyncio's own
loop the write is dropped silently instead, and the request waits out its timeout.

``guard_writes`` makes ``AIOKafkaConnection.send`` close a connection whose transport is closing
and raise ``KafkaConnectionError``, as aiokafka does for an ``OSError``; every caller of ``send``
handles that error by reconnecting. This is aio-libs/aiokafka#1038 (the fix proposed upstream,
#1044, is unreleased in aiokafka 0.14); it goes once a release checks the transport itself.
"""

from __future__ import annotations

from typing import Any

from aiokafka.client import ConnectionGroup
from aiokafka.conn import AIOKafkaConnection, CloseReason
from aiokafka.errors import KafkaConnectionError

_GUARDED = "_batchwire_guards_writes"


def guard_writes() -> None:
    """Patches ``AIOKafkaConnection.send`` once per process (importing ``transport.kafka`` does it)."""
    if getattr(AIOKafkaConnection, _GUARDED, False):
        return
    send = AIOKafkaConnection.send

    def guarded_send(self: Any, request: Any, expect_response: bool = True) -> Any:
        writer = self._writer
        if writer is not None and writer.transport.is_closing():
            self.close(reason=CloseReason.CONNECTION_BROKEN)
            raise KafkaConnectionError(f"Connection at {self._host}:{self._port} broken: the broker reset it")
        return send(self, request, expect_response)

    AIOKafkaConnection.send = guarded_send
    setattr(AIOKafkaConnection, _GUARDED, True)


def bound_requests(client: Any, *, data_timeout_ms: int, coordination_timeout_ms: int) -> None:
    """Gives ``client`` (an ``AIOKafkaClient`` not yet started) two request timeouts instead of one.

    Its fetches, metadata requests and offset lookups, and the set-up of every connection, time out after
    ``data_timeout_ms``; the requests to the group's coordinator (aiokafka's coordination connections)
    after ``coordination_timeout_ms``, since the coordinator holds a JoinGroup until the rebalance ends.
    aiokafka has one timeout for both, so a consumer given the long one waits that long on a broker that is
    frozen or cut off (connected, answering nothing): a metadata refresh sent to it, which every other one
    waits behind, learns the leaders the cluster elected in its place only once it times out, and the
    partitions that broker led are not read meanwhile.
    """
    client._request_timeout_ms = data_timeout_ms  # what each new connection gets: its set-up and requests
    get_conn = client._get_conn
    coordination_timeout_s = coordination_timeout_ms / 1000

    async def get_conn_bounded(node_id: Any, *, group: Any = ConnectionGroup.DEFAULT, no_hint: bool = False) -> Any:
        conn = await get_conn(node_id, group=group, no_hint=no_hint)
        if conn is not None and group == ConnectionGroup.COORDINATION:
            conn._request_timeout = coordination_timeout_s
        return conn

    client._get_conn = get_conn_bounded
