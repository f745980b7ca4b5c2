"""A batcher that alone serves a model keeps one idle worker's credit while it has nothing to send,
so the next request goes out without a claim; one that shares the model keeps none."""

from __future__ import annotations

import asyncio

from batcher.service import Batcher
from batcher.settings import BatcherSettings
from schemas.records import Credit
from tests.support.eventually import eventually
from tests.support.sim_records import PARTITIONS, credit, request
from transport.memory.bus import MemoryBatchBus, MemoryCreditPool, MemoryRequestBus, MemoryTaskStore
from transport.routing import Partitioner


class Counting(MemoryCreditPool):
    def __init__(self) -> None:
        super().__init__()
        self.claims = 0
        """Claims that got a credit."""
        self.offers = 0

    async def claim(self, model: str, timeout_s: float) -> Credit | None:
        got = await super().claim(model, timeout_s)
        self.claims += got is not None  # credits handed out
        return got

    async def offer(self, credit: Credit) -> None:
        self.offers += 1
        await super().offer(credit)


async def start(
    pool: Counting, request_partitions: int, keep_credit_s: float = 1.0
) -> tuple[Batcher, MemoryRequestBus]:
    bus = MemoryRequestBus(Partitioner(("sim",), PARTITIONS))
    settings = BatcherSettings(models=("sim",), request_partitions=request_partitions, keep_credit_s=keep_credit_s)
    batcher = Batcher(settings, bus.consumer(), MemoryBatchBus(2), pool, MemoryTaskStore())
    await batcher.start()
    return batcher, bus


async def test_a_sole_batcher_keeps_a_credit_and_sends_the_next_request_without_a_claim() -> None:
    pool = Counting()
    batcher, bus = await start(pool, PARTITIONS)
    try:
        await bus.producer().send(request("warm"))  # the dispatcher exists once the model was seen
        await pool.offer(credit("w1", 1))
        await eventually(lambda: batcher.batches_sent == 1, "the first batch", timeout_s=5)
        await pool.offer(credit("w2", 1))
        await eventually(
            lambda: pool.claims == 2 and not pool._credits["sim"], "the idle credit to be kept", timeout_s=5
        )

        await bus.producer().send(request("t1"))
        await eventually(lambda: batcher.batches_sent == 2, "the request to go out", timeout_s=5)
        assert pool.claims == 2, "the kept credit should have been spent, not a new one claimed"
    finally:
        await batcher.close()
    assert pool.offers == 2, "no credit was kept, so none goes back at close"


async def test_a_kept_credit_goes_back_to_the_pool_after_a_while() -> None:
    pool = Counting()
    batcher, bus = await start(pool, PARTITIONS, keep_credit_s=0.1)
    try:
        await bus.producer().send(request("warm"))
        await pool.offer(credit("w1", 1))
        await eventually(lambda: batcher.batches_sent == 1, "the first batch", timeout_s=5)
        await pool.offer(credit("w2", 1))
        await eventually(lambda: pool.offers >= 3, "the kept credit to be offered back", timeout_s=5)
    finally:
        await batcher.close()


async def test_a_batcher_that_shares_the_model_keeps_no_credit() -> None:
    pool = Counting()
    # The topic has more partitions than the bus this batcher reads: other batchers own the rest.
    batcher, bus = await start(pool, PARTITIONS * 2)
    try:
        await bus.producer().send(request("warm"))
        await pool.offer(credit("w1", 1))
        await eventually(lambda: batcher.batches_sent == 1, "the first batch", timeout_s=5)
        await pool.offer(credit("w2", 1))
        await asyncio.sleep(0.3)  # asserting an absence: nothing should take the credit meanwhile
        assert await pool.idle("sim") == 1
        assert pool.claims == 1
    finally:
        await batcher.close()
