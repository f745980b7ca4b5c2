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


class WatchedClaims(MemoryCreditPool):
    """Marks the first claim, and a claim that starts after one returned a credit: a hold's second claim."""

    def __init__(self) -> None:
        super().__init__()
        self.claiming = asyncio.Event()
        self.second_claim = asyncio.Event()
        self._handed = 0

    async def claim(self, model: str, timeout_s: float) -> Credit | None:
        (self.second_claim if self._handed else self.claiming).set()
        credit = await super().claim(model, timeout_s)
        self._handed += credit is not None
        return credit


async def test_a_batcher_that_closes_while_it_holds_a_worker_in_reserve_gives_the_credit_back() -> None:
    """Otherwise the worker, idle, gets no batch from any batcher until its credit expires."""
    pool = WatchedClaims()
    bus = MemoryRequestBus(Partitioner(("sim",), PARTITIONS))
    batches = MemoryBatchBus(2)
    ahead_s = 0.0
    policy = FlushPolicy.work_conserving(max_wait_ms=60_000, reserve_ms=HOLD_MS)
    batcher = Batcher(
        BatcherSettings(models=("sim",), policy=policy),
        bus.consumer(),
        batches,
        pool,
        MemoryTaskStore(),
        clock=lambda: time.monotonic() + ahead_s,
    )
    await batcher.start()
    try:
        await bus.producer().send(request("t1"))
        async with asyncio.timeout(10):
            await pool.claiming.wait()
        ahead_s = 1.0  # the worker comes a second after the request: the request waited, the load is light
        now = int(time.time() * 1000)
        idle = Credit("w1", "sim", 1, 1, now, now + 60_000, max_batch=100, busy_ms=100, free_at_ms=now)
        await pool.offer(idle)
        async with asyncio.timeout(10):
            await pool.second_claim.wait()  # held in reserve, claiming a second worker
    finally:
        await batcher.close()
    assert await batches.consumer(1).next(0) is None, "the held worker was sent nothing"
    assert await pool.offered("sim") == [idle], "the held worker's credit is back for the other batchers"
