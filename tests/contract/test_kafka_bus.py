"""What only the Kafka transports can show: raw bytes, missing topics, rebalances between members."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence

import pytest
from aiokafka import AIOKafkaProducer

from batchwire.roles import batcher_group_timing
from schemas.records import Batch, InferenceRequest
from schemas.wire import Names
from tests.support.bus_records import WAIT_S, Partitions, batch, read, request
from tests.support.eventually import eventually
from tests.support.transport_kits import Closer, ensure_topics
from transport.errors import PermanentTransportError
from transport.kafka.consumers import KafkaBatchConsumer, KafkaRequestConsumer
from transport.kafka.group import GroupTiming
from transport.kafka.producers import DEFAULT_REQUEST_TIMEOUT_MS, KafkaBatchProducer, KafkaRequestProducer
from transport.ports import Delivered, TransportError
from transport.routing import Partitioner

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(90)]


@pytest.fixture
async def closer() -> AsyncIterator[Closer]:
    closer = Closer()
    yield closer
    await closer.close_all()


async def test_undecodable_bytes_are_delivered_as_none(kafka_bootstrap: str, names: Names, closer: Closer) -> None:
    await ensure_topics(kafka_bootstrap, {names.request_topic: 1})
    raw = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await raw.start()
    try:
        await raw.send_and_wait(names.request_topic, b"\x00not avro", partition=0)
    finally:
        await raw.stop()
    producer = closer.add(KafkaRequestProducer(kafka_bootstrap, names, Partitioner(["alpha"], 1)))
    await producer.start()
    await producer.send(request("t1", "alpha"))

    consumer = closer.add(KafkaRequestConsumer(kafka_bootstrap, names))
    partitions = Partitions()
    await consumer.start(partitions.on_assigned, partitions.on_revoked)
    got = await read(consumer, 2)

    assert got[0] == Delivered(None, 0, 0), f"got {got[0]}"
    assert got[1].value is not None
    assert got[1].value.task_id == "t1"
    assert consumer.undecodable == 1
    await consumer.commit({0: 1})  # past the bad record: it must never block the partition


async def test_a_lingering_producer_sends_a_run_of_requests_as_one_partitions_batch(
    kafka_bootstrap: str, names: Names, closer: Closer
) -> None:
    """The gateway's producer: ``run`` consecutive requests to one partition, gathered by ``linger_ms``;
    every send still returns only once the broker has its record."""
    await ensure_topics(kafka_bootstrap, {names.request_topic: 4})
    producer = closer.add(KafkaRequestProducer(kafka_bootstrap, names, Partitioner(["alpha"], 4, run=8), linger_ms=20))
    await producer.start()
    sent = [request(f"t{i}", "alpha") for i in range(16)]
    await asyncio.gather(*(producer.send(item) for item in sent))  # each returns once acknowledged

    consumer = closer.add(KafkaRequestConsumer(kafka_bootstrap, names))
    partitions = Partitions()
    await consumer.start(partitions.on_assigned, partitions.on_revoked)
    got = await read(consumer, len(sent))
    by_partition = {
        partition: [d.value.task_id for d in got if d.partition == partition and d.value] for partition in (0, 1)
    }
    assert by_partition == {0: [f"t{i}" for i in range(8)], 1: [f"t{i}" for i in range(8, 16)]}


async def test_a_request_after_an_idle_gap_goes_at_once_and_one_close_behind_it_lingers(
    kafka_bootstrap: str, names: Names, closer: Closer
) -> None:
    """Light load pays no linger: the first request goes in a produce request of its own; the next,
    sent right behind it, waits out the linger for company. Both arrive, in order."""
    await ensure_topics(kafka_bootstrap, {names.request_topic: 1})
    producer = closer.add(KafkaRequestProducer(kafka_bootstrap, names, Partitioner(["alpha"], 1), linger_ms=1000))
    await producer.start()
    started = time.monotonic()
    await producer.send(request("lone", "alpha"))
    lone_s = time.monotonic() - started
    started = time.monotonic()
    await producer.send(request("behind", "alpha"))
    behind_s = time.monotonic() - started
    assert lone_s < 0.5, f"a lone request waited {lone_s:.3f} s: it lingered"
    assert behind_s >= 0.9, f"a request right behind another went after {behind_s:.3f} s, not after the 1 s linger"

    consumer = closer.add(KafkaRequestConsumer(kafka_bootstrap, names))
    partitions = Partitions()
    await consumer.start(partitions.on_assigned, partitions.on_revoked)
    assert [d.value.task_id for d in await read(consumer, 2) if d.value] == ["lone", "behind"]


async def test_producer_refuses_a_missing_topic(kafka_bootstrap: str, names: Names) -> None:
    producer = KafkaRequestProducer(kafka_bootstrap, names, Partitioner(["alpha"], 1), request_timeout_ms=1000)
    with pytest.raises(PermanentTransportError, match=names.request_topic):
        await producer.start()
    assert await producer.ready() is False


async def test_producer_refuses_a_topic_with_too_few_partitions(kafka_bootstrap: str, names: Names) -> None:
    await ensure_topics(kafka_bootstrap, {names.request_topic: 2})
    producer = KafkaRequestProducer(kafka_bootstrap, names, Partitioner(["alpha"], 4))
    with pytest.raises(PermanentTransportError, match="has 2 partitions but the partitioner routes to 4"):
        await producer.start()


async def test_batch_to_a_missing_partition_is_refused(kafka_bootstrap: str, names: Names, closer: Closer) -> None:
    await ensure_topics(kafka_bootstrap, {names.batch_topic("alpha"): 2})
    producer = closer.add(KafkaBatchProducer(kafka_bootstrap, names))
    await producer.start()
    assert await producer.ready("alpha") is True
    with pytest.raises(PermanentTransportError, match="partition 2 does not exist"):
        await producer.send(batch("b1", "alpha"), 2)


async def test_an_uncommitted_batch_goes_to_the_next_owner(kafka_bootstrap: str, names: Names, closer: Closer) -> None:
    await ensure_topics(kafka_bootstrap, {names.batch_topic("alpha"): 1})
    producer = closer.add(KafkaBatchProducer(kafka_bootstrap, names))
    await producer.start()
    sent = batch("b1", "alpha")
    await producer.send(sent, 0)

    crashed = KafkaBatchConsumer(kafka_bootstrap, names, "alpha")
    await crashed.start(_ignore, _ignore)
    first = await crashed.next(WAIT_S)
    assert first is not None
    assert first.value == sent
    await crashed.close()  # without committing: the model call "crashed"

    successor = closer.add(KafkaBatchConsumer(kafka_bootstrap, names, "alpha"))
    await successor.start(_ignore, _ignore)
    again = await successor.next(WAIT_S)
    assert again == first, f"expected {first} redelivered, got {again}"


async def test_revoked_callback_commits_before_the_partition_moves(
    kafka_bootstrap: str, names: Names, closer: Closer
) -> None:
    """A member commits what it handed out inside on_revoked; what it only buffered goes to the new owner."""
    await ensure_topics(kafka_bootstrap, {names.batch_topic("alpha"): 2})
    producer = closer.add(KafkaBatchProducer(kafka_bootstrap, names))
    await producer.start()
    group = f"{names.worker_group('alpha')}.{uuid.uuid4().hex[:6]}"
    first = closer.add(
        KafkaBatchConsumer(
            kafka_bootstrap, names, "alpha", group_id=group, timing=GroupTiming(heartbeat_interval_ms=200)
        )
    )
    handed: list[Delivered[Batch]] = []
    commit_errors: list[BaseException] = []

    async def commit_handed(partitions: frozenset[int]) -> None:
        for delivered in [d for d in handed if d.partition in partitions]:
            try:
                await first.commit(delivered)
            except BaseException as err:
                commit_errors.append(err)
            handed.remove(delivered)

    await first.start(_ignore, commit_handed)
    await eventually(lambda: first.assignment() == {0, 1}, "the first member to own both partitions", timeout_s=WAIT_S)
    batches = {0: batch("b0", "alpha"), 1: batch("b1", "alpha")}
    for partition, item in batches.items():
        await producer.send(item, partition)
    delivered = await first.next(WAIT_S)
    assert delivered is not None
    handed.append(delivered)
    unhandled = 1 - delivered.partition

    second = closer.add(
        KafkaBatchConsumer(
            kafka_bootstrap, names, "alpha", group_id=group, timing=GroupTiming(heartbeat_interval_ms=200)
        )
    )
    await second.start(_ignore, _ignore)
    await eventually(
        lambda: len(first.assignment()) == 1 and len(second.assignment()) == 1,
        "the two members to split",
        timeout_s=WAIT_S,
    )
    assert not commit_errors, f"commit inside on_revoked failed: {commit_errors}"
    assert not handed, "on_revoked must have run for the handed-out batch's partition"

    owner = first if unhandled in first.assignment() else second
    redelivered = await owner.next(WAIT_S)
    assert redelivered is not None, "the batch that was only buffered did not reach its new owner"
    assert redelivered.value == batches[unhandled]
    for member in (first, second):
        extra = await member.next(0.3)
        assert extra is None, f"the committed batch came again: {extra}"


async def test_commit_for_a_partition_not_owned_is_refused(kafka_bootstrap: str, names: Names, closer: Closer) -> None:
    await ensure_topics(kafka_bootstrap, {names.batch_topic("alpha"): 1})
    consumer = closer.add(KafkaBatchConsumer(kafka_bootstrap, names, "alpha"))
    await consumer.start(_ignore, _ignore)
    await eventually(lambda: consumer.assignment() == {0}, "the partition to be assigned", timeout_s=WAIT_S)
    with pytest.raises(PermanentTransportError, match="refused"):
        await consumer.commit(Delivered(batch("b", "alpha"), 7, 0))


async def test_a_long_poll_returns_as_soon_as_a_record_lands(
    kafka_bootstrap: str, names: Names, closer: Closer
) -> None:
    """Why fetch_max_wait_ms may be long: the broker answers a parked fetch when data arrives."""
    await ensure_topics(kafka_bootstrap, {names.request_topic: 1})
    producer = closer.add(KafkaRequestProducer(kafka_bootstrap, names, Partitioner(["alpha"], 1)))
    await producer.start()
    consumer = closer.add(KafkaRequestConsumer(kafka_bootstrap, names, timing=GroupTiming(fetch_max_wait_ms=2000)))
    partitions = Partitions()
    await consumer.start(partitions.on_assigned, partitions.on_revoked)
    await asyncio.wait_for(partitions.assigned.wait(), WAIT_S)
    assert await consumer.fetch(0.3, 10) == []  # the consumer is idle, positioned at the end

    latencies = []
    for index in range(5):
        waiting = asyncio.create_task(consumer.fetch(WAIT_S, 10))
        sent_at = time.monotonic()
        await producer.send(request(f"t{index}", "alpha"))
        got = await waiting
        latencies.append(time.monotonic() - sent_at)
        assert len(got) == 1
    assert sorted(latencies)[2] < 0.5, f"median produce->fetch latency {sorted(latencies)[2]:.3f} s (broker wait 2 s)"


async def _ignore(partitions: frozenset[int]) -> None:
    return None


async def test_records_fetched_in_a_rebalance_whose_callback_failed_come_to_the_service(
    kafka_bootstrap: str, names: Names, closer: Closer
) -> None:
    """A failed rebalance callback surfaces as a retriable fetch error, and the records the fetch it
    failed in brought (read again from the committed offsets) still reach the service: aiokafka has
    moved past them, so dropping them would skip them until the next rebalance."""
    await ensure_topics(kafka_bootstrap, {names.request_topic: 2})
    producer = closer.add(KafkaRequestProducer(kafka_bootstrap, names, Partitioner(["alpha"], 2)))
    await producer.start()
    for n in range(8):
        await producer.send(request(f"t{n}", "alpha"))
    group = f"{names.batcher_group}.{uuid.uuid4().hex[:6]}"
    timing = GroupTiming(heartbeat_interval_ms=200)
    failed: list[frozenset[int]] = []

    async def fails_once(partitions: frozenset[int]) -> None:
        if not failed:
            failed.append(partitions)
            raise RuntimeError("the service could not give its partitions up")

    first = closer.add(KafkaRequestConsumer(kafka_bootstrap, names, group_id=group, timing=timing))
    await first.start(_ignore, fails_once)
    sent: dict[int, set[str]] = {0: set(), 1: set()}
    for item in await read(first, 8):  # nothing committed: the partition's next owner reads them again
        assert item.value is not None
        sent[item.partition].add(item.value.task_id)
    waiting = asyncio.create_task(first.fetch(WAIT_S, 100))  # nothing new: it waits through the rebalance
    second = closer.add(KafkaRequestConsumer(kafka_bootstrap, names, group_id=group, timing=timing))
    await second.start(_ignore, _ignore)
    await eventually(lambda: len(first.assignment()) == 1, "the two members to split", timeout_s=WAIT_S)
    (kept,) = first.assignment()
    fetch: Awaitable[Sequence[Delivered[InferenceRequest]]] = waiting
    again: set[str] = set()
    errors: list[TransportError] = []
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            again.update(item.value.task_id for item in await fetch if item.value is not None)
        except TransportError as err:
            errors.append(err)
        if again == sent[kept] or time.monotonic() > deadline:
            break
        fetch = first.fetch(1.0, 100)
    if not errors:  # every record came in the fetch the callback failed in: the next one says so
        with pytest.raises(TransportError) as raised:
            await first.fetch(0.1, 100)
        errors.append(raised.value)
    assert failed, "the revoked callback ran and failed"
    assert errors and all(err.retriable for err in errors), errors
    assert again == sent[kept], f"partition {kept}'s records read again: {sorted(again)} of {sorted(sent[kept])}"


async def test_a_batcher_whose_revocation_waits_out_a_landing_still_commits(
    kafka_bootstrap: str, names: Names, closer: Closer
) -> None:
    """A batcher's revocation waits for a batch still landing (its ack may take the batch producer's
    whole ack timeout, past the session timeout) and then commits the requests it handed over: its
    group waits for it, so the commit is taken and no other batcher reads those requests again."""
    await ensure_topics(kafka_bootstrap, {names.request_topic: 2})
    producer = closer.add(KafkaRequestProducer(kafka_bootstrap, names, Partitioner(["alpha"], 2)))
    await producer.start()
    group = f"{names.batcher_group}.{uuid.uuid4().hex[:6]}"
    timing = dataclasses.replace(batcher_group_timing(3000), heartbeat_interval_ms=200)
    first = closer.add(KafkaRequestConsumer(kafka_bootstrap, names, group_id=group, timing=timing))
    partitions = Partitions()
    handed: dict[int, int] = {}
    commit_errors: list[BaseException] = []
    revoked_at: list[float] = []

    async def land_then_commit(revoked: frozenset[int]) -> None:
        revoked_at.append(time.monotonic())
        await asyncio.sleep(DEFAULT_REQUEST_TIMEOUT_MS / 1000)  # the landing's ack comes at its timeout
        try:
            await first.commit({p: o for p, o in handed.items() if p in revoked})
        except BaseException as err:
            commit_errors.append(err)

    await first.start(partitions.on_assigned, land_then_commit)
    await eventually(lambda: first.assignment() == {0, 1}, "the first member to own both partitions", timeout_s=WAIT_S)
    for n in range(4):
        await producer.send(request(f"t{n}", "alpha"))
    for record in await read(first, 4):
        handed[record.partition] = max(handed.get(record.partition, 0), record.offset + 1)

    second = closer.add(KafkaRequestConsumer(kafka_bootstrap, names, group_id=group, timing=timing))
    await second.start(_ignore, _ignore)
    await eventually(
        lambda: len(first.assignment()) == 1 and len(second.assignment()) == 1,
        "the two members to split",
        timeout_s=3 * WAIT_S,
    )
    assert revoked_at, "the first member's partitions were revoked"
    assert not commit_errors, f"the commit after the landing was refused: {commit_errors}"
    for member in (first, second):
        again = await member.fetch(0.5, 10)
        assert not again, f"the committed requests came again: {[(r.partition, r.offset) for r in again]}"
