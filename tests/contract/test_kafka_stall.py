"""Records queued at once behind a stall: aiokafka alone gives some up long before its timeout;
batchwire's producer writes them all. And a stall while the request producer's breaker probes the
broker leaves the breaker closed.

A record sent at once (``RenewingProducer.send(at_once=True)``, a gateway's request after a quiet
spell) goes in a record batch of its own, which waits for the partition's pending batch to drain.
aiokafka's ``send_batch`` counts every such wait from its first, so behind a stall the records late
in the queue give up at a turn of it. The stall here is the event loop blocked for ``STALL_S``: the
fault under test (a CPU-starved process), not a synchronisation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer  # type: ignore[import-untyped, unused-ignore]
from aiokafka.errors import KafkaTimeoutError  # type: ignore[import-untyped, unused-ignore]

from schemas.wire import Names
from tests.support.bus_records import one_partition_topic, partition_values
from tests.support.eventually import eventually
from transport.kafka.producers import DEFAULT_REQUEST_TIMEOUT_MS, KafkaRequestProducer, RenewingProducer
from transport.routing import Partitioner

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]

QUEUED = 10
STALL_S = 2.0
"""Well under the produce timeout (5 s); a queue of ``QUEUED`` behind it makes aiokafka's count pass it."""


@pytest.fixture
async def topic(kafka_bootstrap: str, names: Names) -> AsyncIterator[str]:
    async with one_partition_topic(kafka_bootstrap, names.batch_topic("stall")) as name:
        yield name


async def behind_a_stall(send: Callable[[bytes], Coroutine[Any, Any, object]]) -> list[BaseException | None]:
    """Queues ``QUEUED`` sends, blocks the loop for ``STALL_S``, and returns each send's outcome."""
    sends = [asyncio.create_task(send(b"queued-%d" % n)) for n in range(QUEUED)]
    await asyncio.sleep(0)  # each send reaches its wait behind the first
    time.sleep(STALL_S)  # noqa: ASYNC251  # the stall under test: the loop blocked
    outcomes = await asyncio.gather(*sends, return_exceptions=True)
    return [outcome if isinstance(outcome, BaseException) else None for outcome in outcomes]


async def test_aiokafka_alone_gives_up_records_queued_behind_a_stall_shorter_than_its_timeout(
    kafka_bootstrap: str, topic: str
) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap,
        acks="all",
        enable_idempotence=True,
        request_timeout_ms=DEFAULT_REQUEST_TIMEOUT_MS,
    )
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"before", partition=0)

        async def alone(value: bytes) -> object:
            batch = producer.create_batch()
            batch.append(timestamp=None, key=None, value=value)
            batch.close()
            return await (await producer.send_batch(batch, topic, partition=0))

        started = time.monotonic()
        outcomes = await behind_a_stall(alone)
        took_s = time.monotonic() - started
    finally:
        await producer.stop()
    given_up = [outcome for outcome in outcomes if outcome is not None]
    assert given_up, "aiokafka wrote every record: the workaround in RenewingProducer._queue_alone can go"
    assert all(isinstance(outcome, KafkaTimeoutError) for outcome in given_up), given_up
    assert took_s < DEFAULT_REQUEST_TIMEOUT_MS / 1000, f"gave up after {took_s:.1f} s, within its timeout"


async def test_a_renewing_producer_writes_every_record_queued_at_once_behind_a_stall(
    kafka_bootstrap: str, topic: str
) -> None:
    producer = RenewingProducer(
        kafka_bootstrap,
        client_id="stall-test",
        linger_ms=0,
        request_timeout_ms=DEFAULT_REQUEST_TIMEOUT_MS,
        compression_type=None,
        ready_timeout_s=1.0,
    )
    await producer.start()
    try:
        await producer.send(topic, 0, b"before", at_once=True)
        outcomes = await behind_a_stall(lambda value: producer.send(topic, 0, value, at_once=True))
    finally:
        await producer.close()
    assert outcomes == [None] * QUEUED, outcomes
    written = await partition_values(kafka_bootstrap, topic)
    assert written[0] == b"before"
    assert sorted(written[1:]) == sorted(b"queued-%d" % n for n in range(QUEUED)), written


async def test_a_stall_during_the_breakers_probe_leaves_the_request_producer_open_to_sends(
    kafka_bootstrap: str, names: Names
) -> None:
    """The probe a slow send starts (``CircuitBreaker.suspect``) asks the broker for metadata; a loop stall
    while it is in flight is the gateway's, and the broker's answer waits in the socket: the breaker stays
    closed, and the next request is sent."""
    async with one_partition_topic(kafka_bootstrap, names.request_topic):
        producer = KafkaRequestProducer(kafka_bootstrap, names, Partitioner(("stall",), 1))
        await producer.start()
        try:
            await producer.send_encoded(b"before", 0)
            producer.breaker.suspect()
            await asyncio.sleep(0)  # the probe's request goes out
            time.sleep(STALL_S)  # noqa: ASYNC251  # the stall under test: the loop blocked
            await eventually(lambda: producer.breaker._prober is None, "the breaker's probe to end")
            assert producer.breaker.opened == 0, "the loop's stall opened the breaker: requests were refused meanwhile"
            assert await producer.ready(), "the broker answers: the producer is ready"
            await producer.send_encoded(b"after", 0)
        finally:
            await producer.close()
