"""A request for a model nobody serves fails at once instead of pinning its partition's commit point."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from batcher.service import Batcher
from batcher.settings import BatcherSettings
from schemas.records import Credit, InferenceRequest, TaskState, TaskStatus
from tests.support.eventually import eventually
from transport.memory.batches import MemoryBatchBus
from transport.memory.credits import MemoryCreditPool
from transport.memory.requests import MemoryRequestBus, MemoryRequestConsumer
from transport.memory.store import MemoryTaskStore
from transport.routing import Partitioner


async def test_requests_for_unserved_models_fail_and_are_committed() -> None:
    bus = MemoryRequestBus(Partitioner(("sim",), 4))
    store = MemoryTaskStore()
    batcher = Batcher(BatcherSettings(models=("sim",)), bus.consumer(), MemoryBatchBus(1), MemoryCreditPool(), store)
    ended: asyncio.Future[TaskState] = asyncio.get_running_loop().create_future()
    await store.listen_replies("gw", ended.set_result)
    await batcher.start()
    try:
        now = int(time.time() * 1000)
        await bus.producer().send(InferenceRequest("t1", "ghost", "x", now, now + 600_000, "gw"))
        state = await asyncio.wait_for(ended, 5)
        assert state.status is TaskStatus.FAILED
        assert state.error_code == "unknown_model"
        assert "ghost" in (state.error_message or "")
        await eventually(
            lambda: bus.lag() == 0,
            "the request's offset to be committed, not held until its 10-minute deadline",
            timeout_s=5,
        )
    finally:
        await batcher.close()


class SlowCommits(MemoryRequestConsumer):
    """Commits that wait until ``release`` (the group's coordinator moving); ``waiting`` is set once one waits."""

    def __init__(self, bus: MemoryRequestBus) -> None:
        super().__init__(bus)
        self.waiting = asyncio.Event()
        self.release = asyncio.Event()

    async def commit(self, offsets: Mapping[int, int]) -> None:
        self.waiting.set()
        await self.release.wait()
        await super().commit(offsets)


async def test_a_slow_commit_after_an_unknown_model_holds_up_no_batch() -> None:
    """The failed requests' offsets are committed in the background, as handed-over ones are: a commit
    awaited under the hand-over lock would keep every send, and so every idle worker, waiting for it."""
    bus = MemoryRequestBus(Partitioner(("sim",), 4))
    consumer = SlowCommits(bus)
    batches, credits = MemoryBatchBus(1), MemoryCreditPool()
    batcher = Batcher(BatcherSettings(models=("sim",)), consumer, batches, credits, MemoryTaskStore())
    await batcher.start()
    try:
        now = int(time.time() * 1000)
        await bus.producer().send(InferenceRequest("t1", "ghost", "x", now, now + 600_000, "gw"))
        async with asyncio.timeout(10):
            await consumer.waiting.wait()
        await bus.producer().send(InferenceRequest("t2", "sim", "x", now, now + 600_000, "gw"))
        await credits.offer(Credit("w", "sim", 0, 1, now, now + 60_000))
        delivered = await batches.consumer(0).next(10)
        assert delivered is not None and delivered.value is not None, "no batch while a commit waited"
        assert [item.task_id for item in delivered.value.items] == ["t2"]
    finally:
        consumer.release.set()
        await batcher.close()
