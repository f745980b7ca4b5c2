"""Kafka or Redis unreachable for a while: the worker retries and carries on; a permanent error stops it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from gpu_worker.settings import WorkerSettings
from gpu_worker.worker import Worker
from schemas.records import Batch, TaskState, TaskStatus
from tests.support.worker_rig import Rig, ScriptedBackend
from transport.errors import PermanentTransportError
from transport.memory.batches import MemoryBatchConsumer
from transport.memory.store import MemoryTaskStore
from transport.ports import Delivered, TransportError


class FlakyStore(MemoryTaskStore):
    """Fails ``apply`` while ``down`` is set, as a store whose server went away."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.refused = 0
        self.refusing = asyncio.Event()

    async def apply(self, updates: Sequence[TaskState]) -> list[bool]:
        if self.down:
            self.refused += 1
            self.refusing.set()
            raise TransportError("connection refused")
        return await super().apply(updates)


class FlakyConsumer(MemoryBatchConsumer):
    def __init__(self, inner: MemoryBatchConsumer, failures: int, error: TransportError) -> None:
        super().__init__(inner.bus, inner.partition)
        self.failures = failures
        self.error = error

    async def next(self, timeout_s: float) -> Delivered[Batch] | None:
        if self.failures:
            self.failures -= 1
            raise self.error
        return await super().next(timeout_s)


async def test_results_wait_for_the_store_to_come_back() -> None:
    store = FlakyStore()
    rig = Rig(store=store)
    await rig.listen()
    worker = await rig.worker(ScriptedBackend(latency_s=0.05), retry_max_s=0.05)
    batch = rig.batch(["kept"])
    await rig.create(batch)
    store.down = True
    await rig.send(batch)
    async with asyncio.timeout(10):
        while store.refused < 3:
            store.refusing.clear()
            await store.refusing.wait()
    assert worker.healthy(), "an unreachable store must not crash the worker"
    store.down = False
    ended = await rig.ended(["t0"])
    await worker.close()
    assert ended["t0"].output == "tpek"


async def test_a_failing_bus_is_retried() -> None:
    rig = Rig()
    await rig.listen()
    consumer = FlakyConsumer(rig.bus.consumer(0), failures=3, error=TransportError("broker not available"))
    worker = Worker(
        WorkerSettings(worker_id="w", retry_max_s=0.05), consumer, rig.credits, rig.store, ScriptedBackend()
    )
    await worker.start()
    batch = rig.batch(["again"])
    await rig.create(batch)
    await rig.send(batch)
    ended = await rig.ended(["t0"])
    assert worker.healthy()
    await worker.close()
    assert ended["t0"].status is TaskStatus.COMPLETED


async def test_a_permanent_bus_error_stops_the_worker_loudly() -> None:
    rig = Rig()
    consumer = FlakyConsumer(rig.bus.consumer(0), failures=1, error=PermanentTransportError("topic is gone"))
    worker = Worker(WorkerSettings(worker_id="w"), consumer, rig.credits, rig.store, ScriptedBackend())
    await worker.start()
    await asyncio.wait_for(worker.failed.wait(), 5)
    assert isinstance(worker.failure, PermanentTransportError)
    assert not worker.healthy()
    await worker.close()


async def test_shutdown_during_a_store_outage_hands_the_batch_back_in_bounded_time() -> None:
    store = FlakyStore()
    rig = Rig(store=store)
    worker = await rig.worker(ScriptedBackend(), retry_max_s=0.05)
    batch = rig.batch(["stranded"])
    await rig.create(batch)
    store.down = True
    await rig.send(batch)
    async with asyncio.timeout(10):
        while store.refused < 2:
            store.refusing.clear()
            await store.refusing.wait()
    started = time.monotonic()
    await worker.close(drain_timeout_s=0.2)
    assert time.monotonic() - started < 3, "close gives up on the store after the drain time"
    assert worker.batches_done == 0
