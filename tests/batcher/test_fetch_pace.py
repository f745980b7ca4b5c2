"""Under load, with requests already waiting for busy workers, the batcher reads the request topic
at most every ``fetch_pace_ms``; at light load it reads each request at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from batcher.service import Batcher
from batcher.settings import BatcherSettings
from batchwire.routing import Partitioner
from batchwire.transport.base import Delivered
from batchwire.transport.memory import (
    MemoryBatchBus,
    MemoryCreditPool,
    MemoryRequestBus,
    MemoryRequestConsumer,
    MemoryTaskStore,
)
from schemas.records import InferenceRequest
from tests.batcher.test_kept_credit import PARTITIONS, eventually, request


class CountingConsumer(MemoryRequestConsumer):
    """Counts the reads that returned records, and notes when each request was read."""

    def __init__(self, bus: MemoryRequestBus) -> None:
        super().__init__(bus)
        self.reads = 0
        self.read_at: dict[str, float] = {}

    async def fetch(self, timeout_s: float, max_records: int) -> Sequence[Delivered[InferenceRequest]]:
        records = await super().fetch(timeout_s, max_records)
        if records:
            self.reads += 1
            now = time.monotonic()
            self.read_at.update((r.value.task_id, now) for r in records if r.value is not None)
        return records


async def batcher_with_busy_workers(pace_ms: float) -> tuple[Batcher, MemoryRequestBus, CountingConsumer]:
    """No worker offers a credit: every request read waits for one."""
    bus = MemoryRequestBus(Partitioner(("sim",), PARTITIONS))
    consumer = CountingConsumer(bus)
    settings = BatcherSettings(models=("sim",), fetch_pace_ms=pace_ms)
    batcher = Batcher(settings, consumer, MemoryBatchBus(1), MemoryCreditPool(), MemoryTaskStore())
    await batcher.start()
    return batcher, bus, consumer


async def reads_of(requests: int, pace_ms: float) -> int:
    batcher, bus, consumer = await batcher_with_busy_workers(pace_ms)
    producer = bus.producer()
    try:
        for n in range(requests):
            await producer.send(request(f"r{n}"))
            if n % 4 == 3:
                await asyncio.sleep(0.001)  # the load: about 4 requests a millisecond
        await eventually(lambda: batcher.former.held("sim") == requests, "every request to be read")
    finally:
        await batcher.close()
    return consumer.reads


async def test_under_load_reads_are_paced_and_every_request_is_read() -> None:
    at_once = await reads_of(3000, pace_ms=0)
    paced = await reads_of(3000, pace_ms=20)
    assert paced * 3 < at_once, f"{paced} paced reads against {at_once} unpaced"


async def test_at_light_load_each_request_is_read_at_once_even_with_a_long_pace() -> None:
    batcher, bus, consumer = await batcher_with_busy_workers(pace_ms=1000)
    producer = bus.producer()
    sent_at: dict[str, float] = {}
    try:
        for n in range(10):
            sent_at[f"r{n}"] = time.monotonic()
            await producer.send(request(f"r{n}"))
            await eventually(lambda n=n: f"r{n}" in consumer.read_at, f"request r{n} to be read")
            await asyncio.sleep(0.02)  # the load: 50 requests a second, under PACE_ABOVE_RPS
    finally:
        await batcher.close()
    late = {task: round(consumer.read_at[task] - sent, 3) for task, sent in sent_at.items()}
    assert max(late.values()) < 0.5, f"read later than half a second after sending: {late}"
