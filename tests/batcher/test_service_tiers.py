"""Priority tiers through the batcher over in-memory transports: a credit's batch takes the high tier first."""

from __future__ import annotations

import time

from batcher.service import Batcher
from batcher.settings import BatcherSettings
from schemas.records import Credit, InferenceRequest, Priority
from tests.support.eventually import eventually
from transport.memory.batches import MemoryBatchBus
from transport.memory.credits import MemoryCreditPool
from transport.memory.requests import MemoryRequestBus
from transport.memory.store import MemoryTaskStore
from transport.routing import Partitioner


def now_ms() -> int:
    return int(time.time() * 1000)


async def test_a_credit_takes_the_high_requests_that_came_after_a_queue_of_low_ones() -> None:
    requests = MemoryRequestBus(Partitioner(("sim",), 1))  # one partition: arrival order is send order
    batches = MemoryBatchBus(1)
    credits = MemoryCreditPool()
    batcher = Batcher(BatcherSettings(), requests.consumer(), batches, credits, MemoryTaskStore())
    await batcher.start()
    try:
        producer = requests.producer()
        now = now_ms()
        for index in range(8):
            await producer.send(
                InferenceRequest(f"low{index}", "sim", "x", now, now + 30_000, "gw", None, Priority.LOW)
            )
        for index in range(2):
            await producer.send(
                InferenceRequest(f"high{index}", "sim", "x", now, now + 30_000, "gw", None, Priority.HIGH)
            )
        await eventually(lambda: batcher.former.held("sim") == 10, "the batcher to hold all ten requests")
        await credits.offer(Credit("w", "sim", 0, 1, now_ms(), now_ms() + 60_000, max_batch=4))
        delivered = await batches.consumer(0).next(10)
        assert delivered is not None and delivered.value is not None, "a batch should have been sent"
        items = delivered.value.items
        assert [item.task_id for item in items if item.priority is Priority.HIGH] == ["high0", "high1"]
        assert [item.task_id for item in items if item.priority is Priority.LOW] == ["low0", "low1"], (
            "the rest of the batch is the oldest low requests"
        )
        assert batcher.former.held("sim") == 6
    finally:
        await batcher.close()
