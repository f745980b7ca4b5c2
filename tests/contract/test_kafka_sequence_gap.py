"""An idempotent producer after a record it gave up: aiokafka alone refuses every later record on the
partition (``OutOfOrderSequenceNumber``); batchwire's producers replace it and lose nothing.

The gap is made on a healthy broker: a topic whose ``max.message.bytes`` refuses one record after
aiokafka numbered it, as a broker restart does to a record whose partition had no leader too long.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiokafka import AIOKafkaProducer  # type: ignore[import-untyped, unused-ignore]
from aiokafka.errors import (  # type: ignore[import-untyped, unused-ignore]
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
)

from schemas.wire import Names
from tests.support.bus_records import one_partition_topic, partition_values
from tests.support.transport_kits import Closer
from transport.cancelling import cancel_and_wait
from transport.errors import PermanentTransportError
from transport.kafka.group import translate
from transport.kafka.producers import KafkaBatchProducer

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]

MODEL = "sim"
# The broker refuses a record batch over this; aiokafka's own limit (1 MB) lets it through.
MAX_MESSAGE_BYTES = 2000
# Over the producer's batch size (16 KiB) as well, so the record travels in a batch of its own.
TOO_LARGE = b"x" * 20_000


@pytest.fixture
async def closer() -> AsyncIterator[Closer]:
    closer = Closer()
    yield closer
    await closer.close_all()


@pytest.fixture
async def topic(kafka_bootstrap: str, names: Names) -> AsyncIterator[str]:
    configs = {"max.message.bytes": str(MAX_MESSAGE_BYTES)}
    async with one_partition_topic(kafka_bootstrap, names.batch_topic(MODEL), configs) as name:
        yield name


async def test_aiokafka_alone_refuses_every_record_after_one_it_gave_up(kafka_bootstrap: str, topic: str) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"before", partition=0)
        with pytest.raises(MessageSizeTooLargeError):
            await producer.send_and_wait(topic, TOO_LARGE, partition=0)
        for _ in range(2):
            with pytest.raises(OutOfOrderSequenceNumber):
                await producer.send_and_wait(topic, b"after", partition=0)
    finally:
        await producer.stop()
    assert await partition_values(kafka_bootstrap, topic) == [b"before"]


async def test_a_producer_replaced_after_a_gap_writes_every_later_record_once(
    kafka_bootstrap: str, names: Names, topic: str, closer: Closer
) -> None:
    producer = closer.add(KafkaBatchProducer(kafka_bootstrap, names))
    await producer.start()
    await producer.send_encoded(MODEL, b"before", 0)

    # "after" waits behind the refused record, so the old producer numbers it past the gap and the
    # broker refuses it as out of order: it is sent again by the fresh producer.
    refused = asyncio.create_task(producer.send_encoded(MODEL, TOO_LARGE, 0))
    queued = asyncio.create_task(producer.send_encoded(MODEL, b"after", 0))
    outcomes = await asyncio.gather(refused, queued, return_exceptions=True)
    await producer.send_encoded(MODEL, b"later", 0)

    assert isinstance(outcomes[0], PermanentTransportError), outcomes
    assert "MessageSizeTooLarge" in str(outcomes[0]), outcomes[0]
    assert outcomes[1] is None, f"the record queued behind the refused one must be written: {outcomes[1]!r}"
    assert await partition_values(kafka_bootstrap, topic) == [b"before", b"after", b"later"]


async def test_a_producer_whose_sender_task_died_is_replaced_and_the_record_written(
    kafka_bootstrap: str, names: Names, topic: str, closer: Closer
) -> None:
    """aiokafka's sender task ended with an error (a bug, a ``RuntimeError`` from a closed transport):
    aiokafka fails every later send at once with that error, and never starts another sender."""
    producer = closer.add(KafkaBatchProducer(kafka_bootstrap, names))
    await producer.start()
    await producer.send_encoded(MODEL, b"before", 0)
    aio = producer._producer.producer
    died = KafkaError("Unexpected error during batch delivery")
    await cancel_and_wait(aio._sender.sender_task)  # as it ends on an error: aiokafka stores that error
    aio._message_accumulator.fail_all(died)
    with pytest.raises(KafkaError):
        await aio.send(topic, b"refused", partition=0)

    await producer.send_encoded(MODEL, b"after", 0)

    assert producer._producer.renewals == 1
    assert await partition_values(kafka_bootstrap, topic) == [b"before", b"after"]


@pytest.mark.parametrize(
    ("error", "permanent"),
    [(KafkaTimeoutError(), False), (KafkaConnectionError(), False), (MessageSizeTooLargeError(), True)],
)
def test_a_timeout_is_retried_whatever_aiokafka_marks_it(error: Exception, permanent: bool) -> None:
    """A send buffer that did not drain while a broker was away drains once it is back."""
    assert isinstance(translate("producing", error), PermanentTransportError) is permanent
