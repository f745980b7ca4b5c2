"""A request's priority tier survives every transport: the memory bus, Kafka, and the express copies."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import pytest

from schemas.records import InferenceRequest, Priority
from schemas.wire import Names
from tests.support.bus_records import WAIT_S, Partitions, read, request
from tests.support.transport_kits import MODELS, Closer, RequestBusKit, ensure_topics
from transport.express.copies import RedisExpress
from transport.express.requests import ExpressRequestConsumer, ExpressRequestProducer
from transport.kafka.consumers import KafkaRequestConsumer
from transport.kafka.group import GroupTiming
from transport.kafka.producers import KafkaRequestProducer
from transport.ports import Delivered
from transport.routing import Partitioner

pytestmark = pytest.mark.timeout(90)


async def test_each_tier_is_read_as_it_was_sent(request_bus: RequestBusKit) -> None:
    producer = await request_bus.producer()
    sent = [replace(request(f"t-{tier}", MODELS[0]), priority=tier) for tier in Priority]
    for item in sent:
        await producer.send(item)
    consumer = request_bus.consumer()
    partitions = Partitions()
    await consumer.start(partitions.on_assigned, partitions.on_revoked)
    await asyncio.wait_for(partitions.assigned.wait(), WAIT_S)
    got = {d.value.task_id: d.value.priority for d in await read(consumer, len(sent)) if d.value is not None}
    assert got == {s.task_id: s.priority for s in sent}


@pytest.mark.kafka
async def test_the_express_copy_and_the_kafka_record_both_carry_the_tier(infra: Any, names: Names) -> None:
    model = "alpha"
    await ensure_topics(infra.kafka_bootstrap, {names.request_topic: 1})
    closer = Closer()
    try:
        consumer = ExpressRequestConsumer(
            KafkaRequestConsumer(infra.kafka_bootstrap, names, timing=GroupTiming(heartbeat_interval_ms=500)),
            infra.redis_url,
            names,
        )
        partitions = Partitions()
        await consumer.start(partitions.on_assigned, partitions.on_revoked)
        closer.add(consumer)
        await asyncio.wait_for(partitions.assigned.wait(), WAIT_S)
        kafka = KafkaRequestProducer(infra.kafka_bootstrap, names, Partitioner((model,), 1))
        producer = ExpressRequestProducer(kafka, RedisExpress(infra.redis_url, names))
        await producer.start()
        closer.add(producer)
        now = int(time.time() * 1000)
        sent = InferenceRequest("t1", model, "input", now, now + 30_000, "g1", None, Priority.LOW)
        await producer.send(sent)
        got: list[Delivered[InferenceRequest]] = []
        async with asyncio.timeout(WAIT_S):
            while len(got) < 2:
                got.extend(await consumer.fetch(1.0, 100))
        assert sorted(d.via for d in got) == ["express", "kafka"], f"one copy and one record, got {got}"
        assert [d.value.priority for d in got if d.value is not None] == [Priority.LOW, Priority.LOW]
    finally:
        await closer.close_all()
