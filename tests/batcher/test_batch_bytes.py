"""A batch is one record on the batch topic, and Kafka refuses a record over 1 MiB however often it is
sent: a batch of long inputs (each one accepted) is cut to fit, the rest going to the next credit."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from batcher.service import Batcher
from batcher.settings import BatcherSettings
from schemas.records import Batch, Credit, InferenceRequest
from schemas.wire import Names
from tests.support.eventually import eventually
from tests.support.transport_kits import Closer, ensure_topics
from transport.kafka.producers import KafkaBatchProducer
from transport.memory.credits import MemoryCreditPool
from transport.memory.requests import MemoryRequestBus
from transport.memory.store import MemoryTaskStore
from transport.routing import Partitioner

pytestmark = pytest.mark.timeout(60)

LONG = 60_000
"""Characters of each input, under the gateway's --max-input-chars (65536): 20 of them hold 1.2 MB."""


class LandedBatches(KafkaBatchProducer):
    """The Kafka batch producer, noting the size of each batch the broker acknowledged."""

    def __init__(self, bootstrap: str, names: Names) -> None:
        super().__init__(bootstrap, names)
        self.landed: list[int] = []

    async def send(self, batch: Batch, partition: int) -> None:
        await super().send(batch, partition)
        self.landed.append(len(batch.items))


@pytest.fixture
async def closer() -> AsyncIterator[Closer]:
    closer = Closer()
    yield closer
    await closer.close_all()


def now_ms() -> int:
    return int(time.time() * 1000)


async def test_requests_whose_inputs_together_pass_a_kafka_record_land_in_several_batches(
    infra: Any, names: Names, closer: Closer
) -> None:
    await ensure_topics(infra.kafka_bootstrap, {names.batch_topic("sim"): 1})
    producer = closer.add(LandedBatches(infra.kafka_bootstrap, names))
    await producer.start()
    requests = MemoryRequestBus(Partitioner(("sim",), 1))
    credits = MemoryCreditPool()
    settings = BatcherSettings(models=("sim",), request_partitions=1, send_retry_s=0.05)
    batcher = closer.add(Batcher(settings, requests.consumer(), producer, credits, MemoryTaskStore()))
    for n in range(20):  # queued while every worker is busy: one credit would take them all
        now = now_ms()
        await requests.producer().send(InferenceRequest(f"r{n}", "sim", "x" * LONG, now, now + 30_000, None))
    await batcher.start()
    for seq in range(1, 4):
        now = now_ms()
        await credits.offer(Credit("w", "sim", 0, seq, now, now + 60_000))

    await eventually(lambda: sum(producer.landed) == 20, "the 20 requests on the batch topic", timeout_s=10)
    assert len(producer.landed) == 2, f"one batch of those that fit in a record, then the rest: {producer.landed}"
    await eventually(lambda: requests.lag() == 0, "every request committed once its batch landed", timeout_s=10)
