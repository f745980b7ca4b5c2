"""A request for a model nobody serves fails at once instead of pinning its partition's commit point."""

from __future__ import annotations

import asyncio
import time

from batcher.service import Batcher
from batcher.settings import BatcherSettings
from schemas.records import InferenceRequest, TaskState, TaskStatus
from tests.support.eventually import eventually
from transport.memory.batches import MemoryBatchBus
from transport.memory.credits import MemoryCreditPool
from transport.memory.requests import MemoryRequestBus
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
