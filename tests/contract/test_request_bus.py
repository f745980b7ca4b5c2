"""Request bus contract: what gateways send, the batcher reads once, and resumes after its commits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from schemas.records import InferenceRequest
from tests.support.bus_records import WAIT_S, Partitions, read, request
from tests.support.transport_kits import MODELS, REQUEST_PARTITIONS, RequestBusKit
from transport.memory.requests import MemoryRequestBus
from transport.ports import Delivered, RequestConsumer
from transport.routing import Partitioner

pytestmark = pytest.mark.timeout(90)


async def started(consumer: RequestConsumer) -> Partitions:
    partitions = Partitions()
    await consumer.start(partitions.on_assigned, partitions.on_revoked)
    await asyncio.wait_for(partitions.assigned.wait(), WAIT_S)
    return partitions


def next_offsets(records: Sequence[Delivered[InferenceRequest]]) -> dict[int, int]:
    offsets: dict[int, int] = {}
    for record in records:
        offsets[record.partition] = max(offsets.get(record.partition, 0), record.offset + 1)
    return offsets


async def test_every_request_is_read_once_from_its_models_partitions(request_bus: RequestBusKit) -> None:
    producer = await request_bus.producer()
    assert await producer.ready() is True
    sent = [request(f"t{i}", MODELS[i % 2]) for i in range(20)]
    for item in sent:
        await producer.send(item)

    consumer = request_bus.consumer()
    partitions = await started(consumer)
    assert partitions.current == frozenset(range(REQUEST_PARTITIONS)) == consumer.assignment()
    got = await read(consumer, len(sent))

    assert sorted(d.value.task_id for d in got if d.value) == sorted(s.task_id for s in sent)
    for delivered in got:
        assert delivered.value is not None
        model_partitions = request_bus.partitioner.partitions_for(delivered.value.model)
        assert delivered.partition in model_partitions, f"{delivered} outside {model_partitions}"
    for partition in {d.partition for d in got}:
        offsets = [d.offset for d in got if d.partition == partition]
        assert offsets == sorted(set(offsets)), f"partition {partition}: offsets out of order or repeated: {offsets}"
    assert await consumer.fetch(0.05, 10) == [], "nothing more was sent"


async def test_a_new_consumer_resumes_after_the_committed_offsets(request_bus: RequestBusKit) -> None:
    producer = await request_bus.producer()
    sent = [request(f"t{i}", MODELS[i % 2]) for i in range(12)]
    for item in sent:
        await producer.send(item)

    first = request_bus.consumer()
    first_partitions = await started(first)
    got = await read(first, len(sent))
    handled = [d for d in got if d.offset < 1]  # the first record of each partition
    await first.commit(next_offsets(handled))
    await first.close()
    assert first_partitions.revoked == [frozenset(range(REQUEST_PARTITIONS))], "close must revoke what it held"

    second = request_bus.consumer()
    await started(second)
    again = await read(second, len(sent) - len(handled))

    expected = {d.value.task_id for d in got if d.value and d not in handled}
    assert {d.value.task_id for d in again if d.value} == expected
    assert await second.fetch(0.05, 10) == [], "committed records must not come again"


async def test_fetch_waits_at_most_its_timeout(request_bus: RequestBusKit) -> None:
    consumer = request_bus.consumer()
    await started(consumer)
    started_at = time.monotonic()

    assert await consumer.fetch(0.2, 10) == []
    elapsed = time.monotonic() - started_at
    assert elapsed < 2.0, f"fetch(0.2) took {elapsed:.2f} s"


async def test_fetch_returns_a_record_sent_while_waiting(request_bus: RequestBusKit) -> None:
    producer = await request_bus.producer()
    consumer = request_bus.consumer()
    await started(consumer)

    waiting = asyncio.create_task(consumer.fetch(WAIT_S, 10))
    await producer.send(request("t1", MODELS[0]))
    got = await asyncio.wait_for(waiting, WAIT_S)
    assert [d.value.task_id for d in got if d.value] == ["t1"]


async def test_a_backlog_on_one_models_partitions_does_not_hide_another_models_requests_in_memory() -> None:
    """Each fetch of the in-memory bus begins where the last one stopped, as Kafka's fetches go round the
    partitions: a batcher that reads a few at a time reaches every model's requests, not only the
    lowest partitions' backlog."""
    bus = MemoryRequestBus(Partitioner(MODELS, REQUEST_PARTITIONS))
    producer, consumer = bus.producer(), bus.consumer()
    for index in range(100):
        await producer.send(request(f"a{index}", "alpha"))
    await producer.send(request("b0", "beta"))
    await started(consumer)
    read: list[str] = []
    for _ in range(3):
        read.extend(record.value.task_id for record in await consumer.fetch(0, 10))
    assert "b0" in read, f"three fetches of 10 reached only {read}"
