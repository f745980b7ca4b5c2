"""The batcher counts a read's tokens on a thread: a rebalance may take the read's partitions meanwhile."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import pytest

from batcher.policy import FlushPolicy
from batcher.service import Batcher
from batcher.settings import BatcherSettings
from schemas.records import InferenceRequest
from tests.support.eventually import eventually
from transport.memory.batches import MemoryBatchBus
from transport.memory.credits import MemoryCreditPool
from transport.memory.requests import MemoryRequestBus, MemoryRequestConsumer
from transport.memory.store import MemoryTaskStore
from transport.ports import Delivered
from transport.routing import Partitioner


class CountedFetches(MemoryRequestConsumer):
    """Counts its fetches: the read loop fetches again once it has taken in the last read."""

    fetches = 0

    async def fetch(self, timeout_s: float, max_records: int) -> Sequence[Delivered[InferenceRequest]]:
        self.fetches += 1
        return await super().fetch(timeout_s, max_records)


async def test_a_read_whose_partition_is_revoked_while_counted_is_left_to_the_new_owner() -> None:
    """The revoked callback committed before the read and dropped what the batcher held there: the
    new owner reads those requests again from that offset, so this batcher must not hold them too."""
    counting, release = threading.Event(), threading.Event()

    def count(text: str) -> int:
        counting.set()
        release.wait(30)
        return 1

    bus = MemoryRequestBus(Partitioner(("sim",), 1))
    consumer = CountedFetches(bus)
    policy = FlushPolicy.named("work-conserving", 8, 1000.0, max_batch_tokens=64)
    batcher = Batcher(
        BatcherSettings(policy=policy, models=("sim",)),
        consumer,
        MemoryBatchBus(1),
        MemoryCreditPool(),
        MemoryTaskStore(),
        count_tokens=count,
    )
    await batcher.start()
    try:
        now = int(time.time() * 1000)
        await bus.producer().send(InferenceRequest("t1", "sim", "x", now, now + 600_000, "gw"))
        await eventually(counting.is_set, "the read's count on its thread")
        fetched = consumer.fetches
        await consumer.close()  # the revocation of every partition, as a rebalance runs it
        release.set()
        await eventually(lambda: consumer.fetches > fetched, "the read loop's next fetch")
        assert batcher.former.held("sim") == 0, "a request of a revoked partition is held: its new owner has it too"
        assert batcher.offsets.unfinished() == 0, "an offset of a revoked partition is tracked for a commit"
    finally:
        release.set()
        await batcher.close()


async def test_an_input_over_the_budget_is_logged_once_per_model_naming_the_gateways_setting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only a gateway given the batchers' --max-batch-tokens refuses an input over it (413); one without
    it admits the input, which then runs alone past the budget. The batcher says so, once per model, so
    the disagreement between the roles shows instead of only as a worker's memory or latency."""
    bus = MemoryRequestBus(Partitioner(("sim",), 1))
    policy = FlushPolicy.named("work-conserving", 8, 1000.0, max_batch_tokens=64)
    batcher = Batcher(
        BatcherSettings(policy=policy, models=("sim",)),
        MemoryRequestConsumer(bus),
        MemoryBatchBus(1),
        MemoryCreditPool(),
        MemoryTaskStore(),
    )
    caplog.set_level(logging.WARNING, logger="batcher.service")
    await batcher.start()
    try:
        now = int(time.time() * 1000)
        producer = bus.producer()
        await producer.send(InferenceRequest("short", "sim", "x" * 40, now, now + 600_000, "gw"))
        await eventually(lambda: batcher.former.held("sim") == 1, "the short request held")
        assert not caplog.records, f"an input within the budget is logged: {caplog.messages}"
        for task_id in ("long-1", "long-2"):
            await producer.send(InferenceRequest(task_id, "sim", "y" * 400, now, now + 600_000, "gw"))
        await eventually(lambda: batcher.former.held("sim") == 3, "both long requests held")
    finally:
        await batcher.close()
    warned = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warned) == 1, f"expected one warning for the model's inputs over the budget, got {warned}"
    assert "100 tokens" in warned[0] and "--max-batch-tokens" in warned[0] and "64" in warned[0], warned[0]
