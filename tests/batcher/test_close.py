"""A batcher's close ends its loops whatever instant it comes in.

On Python 3.11 ``asyncio.wait_for`` swallows a cancellation that lands in the turn after its awaitable
finished; a loop that waits with it then runs on after ``close`` cancelled it, and the process hangs
on SIGTERM. These tests close a batcher at each turn after a request arrives, so that one of them
lands in that window.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from batcher.service import Batcher
from batcher.settings import BatcherSettings
from schemas.records import InferenceRequest
from transport.memory.batches import MemoryBatchBus
from transport.memory.credits import MemoryCreditPool
from transport.memory.requests import MemoryRequestBus
from transport.memory.store import MemoryTaskStore
from transport.routing import Partitioner

SETTLE = 5
"""Event-loop turns after the start: every loop has reached its first wait."""


async def _turns(count: int) -> None:
    """Lets the event loop run ``count`` turns: it places the close, it waits for nothing."""
    for _ in range(count):
        await asyncio.sleep(0)


def _batcher(bus: MemoryRequestBus) -> Batcher:
    return Batcher(
        BatcherSettings(models=("sim",)), bus.consumer(), MemoryBatchBus(1), MemoryCreditPool(), MemoryTaskStore()
    )


@pytest.mark.parametrize("turns", range(12))
async def test_close_ends_every_loop_at_any_turn_after_an_arrival(turns: int) -> None:
    bus = MemoryRequestBus(Partitioner(("sim",), 1))
    batcher = _batcher(bus)
    await batcher.start()
    await _turns(SETTLE)
    now = int(time.time() * 1000)
    await bus.producer().send(InferenceRequest("t1", "sim", "x", now, now + 600_000, "gw"))
    await _turns(turns)
    try:
        async with asyncio.timeout(5):
            await batcher.close()
    except TimeoutError:
        pytest.fail(f"close {turns} turns after an arrival did not end the batcher's loops within 5 s")


async def test_close_right_after_the_start_closes_the_loops_that_never_ran() -> None:
    """No "coroutine was never awaited" warning (pytest turns it into an error) and no hang."""
    bus = MemoryRequestBus(Partitioner(("sim",), 1))
    batcher = _batcher(bus)
    await batcher.start()
    async with asyncio.timeout(5):
        await batcher.close()
    assert batcher.failure is None, f"a close is not a crash: {batcher.failure!r}"
