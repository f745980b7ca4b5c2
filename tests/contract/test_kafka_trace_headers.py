"""The W3C trace context on the Kafka records of requests and batches: a ``traceparent`` header for
tools that read the topics, beside the record's own field; no header while tracing is off."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from schemas.codec import decode_batch, decode_request
from schemas.wire import TRACEPARENT_HEADER, Names
from tests.support.bus_records import WAIT_S, batch, request
from tests.support.transport_kits import Closer, ensure_topics
from transport.kafka.producers import KafkaBatchProducer, KafkaRequestProducer
from transport.routing import Partitioner

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(90)]

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
async def closer() -> AsyncIterator[Closer]:
    closer = Closer()
    yield closer
    await closer.close_all()


async def _raw(bootstrap: str, topic: str, count: int) -> list[ConsumerRecord[bytes, bytes]]:
    # In no group: a group member with auto-commit that stops before it has found its coordinator
    # retries its last commit forever (aiokafka 0.14), and on a broker no group has used yet the first
    # lookup answers "coordinator not available" while the broker creates __consumer_offsets.
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        await consumer.seek_to_beginning()
        got: list[ConsumerRecord[bytes, bytes]] = []
        while len(got) < count:
            batches = await consumer.getmany(timeout_ms=int(WAIT_S * 1000), max_records=count - len(got))
            assert batches, f"read {len(got)} of {count} records in {WAIT_S} s"
            for records in batches.values():
                got.extend(records)
        return got
    finally:
        await consumer.stop()


async def test_a_traced_request_carries_its_traceparent_as_a_header(
    kafka_bootstrap: str, names: Names, closer: Closer
) -> None:
    await ensure_topics(kafka_bootstrap, {names.request_topic: 1})
    producer = closer.add(KafkaRequestProducer(kafka_bootstrap, names, Partitioner(["sim"], 1)))
    await producer.start()
    await producer.send(dataclasses.replace(request("traced", "sim"), traceparent=TRACEPARENT))
    await producer.send(request("untraced", "sim"))
    traced, untraced = await _raw(kafka_bootstrap, names.request_topic, 2)
    assert list(traced.headers) == [(TRACEPARENT_HEADER, TRACEPARENT.encode())]
    assert decode_request(traced.value or b"").traceparent == TRACEPARENT
    assert list(untraced.headers) == [], "no header while tracing is off"


async def test_a_traced_batch_carries_its_traceparent_as_a_header(
    kafka_bootstrap: str, names: Names, closer: Closer
) -> None:
    await ensure_topics(kafka_bootstrap, {names.batch_topic("sim"): 1})
    producer = closer.add(KafkaBatchProducer(kafka_bootstrap, names))
    await producer.start()
    await producer.send(dataclasses.replace(batch("b1", "sim"), traceparent=TRACEPARENT), 0)
    (record,) = await _raw(kafka_bootstrap, names.batch_topic("sim"), 1)
    assert list(record.headers) == [(TRACEPARENT_HEADER, TRACEPARENT.encode())]
    assert decode_batch(record.value or b"").traceparent == TRACEPARENT
