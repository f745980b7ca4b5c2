"""aiokafka's broker connection, made to fail as a lost connection when the broker reset it.

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
