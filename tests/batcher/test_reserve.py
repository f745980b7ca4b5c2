"""The low-load reserve (``BatchFormer.reserve_s``) holds an idle worker only for requests that
waited for one: a request that found a worker idle goes out at once, however slow the claim."""

from __future__ import annotations

import asyncio
import time

from batcher.policy import FlushPolicy
from batcher.service import Batcher
from batcher.settings import BatcherSettings
from schemas.records import Credit
from tests.support.sim_records import PARTITIONS, request
from transport.memory.batches import MemoryBatchBus
from transport.memory.credits import MemoryCreditPool
from transport.memory.requests import MemoryRequestBus
from transport.memory.store import MemoryTaskStore
from transport.routing import Partitioner

HOLD_MS = 2000.0
"""The reserve: long, so that a hold cannot pass for a slow machine."""
CLAIM_S = 0.05
"""A claim's round trip to a loaded credit store, well past ``FlushPolicy.fresh_ms``."""


class SlowClaims(MemoryCreditPool):
    async def claim(self, model: str, timeout_s: float) -> Credit | None:
        await asyncio.sleep(CLAIM_S)  # the store's latency, not a wait for anything
        return await super().claim(model, timeout_s)


async def test_a_request_that_finds_a_worker_idle_is_not_held_in_reserve_by_a_slow_claim() -> None:
    pool = SlowClaims()
    bus = MemoryRequestBus(Partitioner(("sim",), PARTITIONS))
    batches = MemoryBatchBus(2)
    settings = BatcherSettings(models=("sim",), policy=FlushPolicy.work_conserving(reserve_ms=HOLD_MS))
    batcher = Batcher(settings, bus.consumer(), batches, pool, MemoryTaskStore())
    await batcher.start()
    try:
        now = int(time.time() * 1000)
        idle = Credit("w1", "sim", 1, 1, now, now + 60_000, max_batch=100, busy_ms=100, free_at_ms=now)
        await pool.offer(idle)  # the worker is idle before the request comes
        sent = time.monotonic()
        await bus.producer().send(request("t1"))
        delivered = await batches.consumer(1).next(10)
        took_s = time.monotonic() - sent
        assert delivered is not None and delivered.value is not None, "the request should have gone out"
        assert [item.task_id for item in delivered.value.items] == ["t1"]
        assert took_s < HOLD_MS / 2000, f"sent after {took_s:.3f} s: held in reserve for a worker it had found idle"
    finally:
        await batcher.close()
