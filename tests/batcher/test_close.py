"""A batcher's close ends its loops whatever instant it comes in, and gives back the credits they
claimed and did not use.

On Python 3.11 ``asyncio.wait_for`` swallows a cancellation that lands in the turn after its awaitable
finished; a loop that waits with it then runs on after ``close`` cancelled it, and the process hangs
on SIGTERM. These tests close a batcher at each turn after a request arrives, so that one of them
lands in that window.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from batcher.dispatch import Dispatcher
from batcher.policy import BatchFormer, FlushPolicy, Pending
from batcher.service import Batcher
from batcher.settings import BatcherSettings
from schemas.records import Credit, InferenceRequest
from tests.support.sim_records import PARTITIONS, request
from transport.cancelling import RECANCEL_S
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


OFFER_S = 4 * RECANCEL_S
"""A credit's offer, as slow as a loaded Redis: longer than a closing batcher waits before it
cancels a loop again."""


class WatchedClaims(MemoryCreditPool):
    """Offers that take ``OFFER_S``; marks the first claim, a claim that returned a credit, and a claim
    that starts after one returned a credit (a hold's second claim)."""

    def __init__(self) -> None:
        super().__init__()
        self.claiming = asyncio.Event()
        self.handed = asyncio.Event()
        self.second_claim = asyncio.Event()

    async def offer(self, credit: Credit, *, after_ms: int = 0) -> None:
        await asyncio.sleep(OFFER_S)  # the store's latency, not a wait for anything
        await super().offer(credit, after_ms=after_ms)

    async def claim(self, model: str, timeout_s: float) -> Credit | None:
        (self.second_claim if self.handed.is_set() else self.claiming).set()
        credit = await super().claim(model, timeout_s)
        if credit is not None:
            self.handed.set()
        return credit


def _idle_credit() -> Credit:
    now = int(time.time() * 1000)
    return Credit("w1", "sim", 1, 1, now, now + 60_000, max_batch=100, busy_ms=100, free_at_ms=now)


async def test_a_batcher_that_closes_while_it_holds_a_worker_in_reserve_gives_the_credit_back() -> None:
    """Otherwise the worker, idle, gets no batch from any batcher until its credit expires."""
    pool = WatchedClaims()
    bus = MemoryRequestBus(Partitioner(("sim",), PARTITIONS))
    batches = MemoryBatchBus(2)
    ahead_s = 0.0
    policy = FlushPolicy.work_conserving(max_wait_ms=60_000, reserve_ms=2_000)
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
        idle = _idle_credit()
        await super(WatchedClaims, pool).offer(idle)
        async with asyncio.timeout(10):
            await pool.second_claim.wait()  # held in reserve, claiming a second worker
    finally:
        await batcher.close()
    assert await batches.consumer(1).next(0) is None, "the held worker was sent nothing"
    assert await pool.offered("sim") == [idle], "the held worker's credit is back for the other batchers"


async def test_a_closing_batcher_gives_back_the_credit_of_a_send_that_waits_for_the_hand_over() -> None:
    """``Batcher.close`` cancels the loops while it holds the hand-over lock (a rebalance may hold it
    before): a loop that claimed a credit and waits for the lock to send has not used it."""
    pool = WatchedClaims()
    former = BatchFormer[InferenceRequest](FlushPolicy.work_conserving(reserve_ms=0), time.monotonic)
    handover = asyncio.Lock()

    def expire(_: object) -> None:
        return None

    dispatcher = Dispatcher(
        BatcherSettings(models=("sim",)),
        former,
        pool,
        MemoryBatchBus(2),
        MemoryTaskStore(),
        handover=handover,
        freed=lambda: None,
        requeued=lambda: None,
        assignment=lambda: frozenset(range(PARTITIONS)),
        handed_over=lambda _: None,
        expire=expire,
        spawn=lambda loop, name: asyncio.create_task(loop, name=name),
    )
    idle = _idle_credit()
    await super(WatchedClaims, pool).offer(idle)
    async with handover:
        now = time.monotonic()
        former.add("sim", Pending(request("t1"), 0, 0, now, now + 30.0))
        dispatcher.arrived("sim")
        async with asyncio.timeout(10):
            await pool.handed.wait()  # from the claim to the lock the loop does not yield: it waits for it now
        dispatcher.cancel()
    await dispatcher.cancelled()
    assert former.ready("sim"), "nothing was sent"
    assert await pool.offered("sim") == [idle], "the claimed credit is back for the other batchers"
