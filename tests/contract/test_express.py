"""Express copies over Redis beside the Kafka records, over the real Kafka broker and Redis.

A batch runs once whichever copy comes first, the Kafka offset is committed for a batch run from
the express list, and a batch Kafka refused is taken back from the list. A request's copy and
record are batched once, and the record is committed after the copy's batch went out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from redis.asyncio import Redis

from batcher.service import Batcher
from batcher.settings import BatcherSettings
from schemas.codec import encode_batch
from schemas.records import Batch, BatchItem, Credit, InferenceRequest, TaskState, TaskStatus
from schemas.wire import Names
from tests.support.eventually import eventually
from tests.support.transport_kits import Closer, ensure_topics
from transport.express.batches import ExpressBatchConsumer, ExpressBatchProducer
from transport.express.copies import RedisExpress
from transport.express.requests import ExpressRequestConsumer, ExpressRequestProducer
from transport.kafka.consumers import KafkaBatchConsumer, KafkaRequestConsumer
from transport.kafka.group import GroupTiming
from transport.kafka.producers import KafkaBatchProducer, KafkaRequestProducer
from transport.memory.bus import MemoryBatchBus, MemoryCreditPool, MemoryTaskStore
from transport.ports import Delivered
from transport.redis.deliveries import RedisDeliveryLog
from transport.redis.store import RedisTaskStore
from transport.routing import Partitioner

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(90)]

MODEL = "alpha"
WAIT_S = 30.0


def batch(batch_id: str, worker: str = "w1") -> Batch:
    now = int(time.time() * 1000)
    items = (BatchItem(f"{batch_id}-0", "input", now, now + 30_000, "g1"),)
    return Batch(batch_id, MODEL, "batcher-1", now, "idle_worker", credit=f"{worker}:1", items=items)


class Kit:
    def __init__(self, infra: Any, names: Names) -> None:
        self.infra = infra
        self.names = names
        self.closer = Closer()

    def express(self) -> RedisExpress:
        return RedisExpress(self.infra.redis_url, self.names)

    def redis(self) -> Redis:
        """A Redis client of the test's own, closed at teardown."""
        return self.closer.add(Redis.from_url(self.infra.redis_url))  # type: ignore[no-any-return]

    async def producer(self, record_delay_s: float = 0.0) -> ExpressBatchProducer:
        kafka = KafkaBatchProducer(self.infra.kafka_bootstrap, self.names)
        producer = ExpressBatchProducer(kafka, self.express(), record_delay_s=record_delay_s)
        await producer.start()
        return self.closer.add(producer)  # type: ignore[no-any-return]

    async def consumer(
        self,
        worker: str = "w1",
        confirm_timeout_s: float = WAIT_S,
        *,
        owns: bool = True,
        express: RedisExpress | None = None,
    ) -> ExpressBatchConsumer:
        kafka = KafkaBatchConsumer(
            self.infra.kafka_bootstrap, self.names, MODEL, timing=GroupTiming(heartbeat_interval_ms=500)
        )
        express = self.express() if express is None else express
        consumer = ExpressBatchConsumer(kafka, express, worker, confirm_timeout_s=confirm_timeout_s)
        owned: set[int] = set()

        async def assigned(partitions: frozenset[int]) -> None:
            owned.update(partitions)

        async def revoked(partitions: frozenset[int]) -> None:
            owned.difference_update(partitions)

        await consumer.start(assigned, revoked)
        self.closer.add(consumer)
        if owns:
            await eventually(lambda: bool(owned), "the worker to own the batch partition", timeout_s=WAIT_S)
        return consumer


@pytest.fixture
async def kit(infra: Any, names: Names) -> AsyncIterator[Kit]:
    await ensure_topics(infra.kafka_bootstrap, {names.batch_topic(MODEL): 1})
    kit = Kit(infra, names)
    yield kit
    await kit.closer.close_all()


async def test_a_batch_runs_once_from_the_express_list_and_its_kafka_offset_is_committed(kit: Kit) -> None:
    worker = await kit.consumer()
    producer = await kit.producer()
    sent = batch("b1")
    await producer.send(sent, 0)

    delivered = await worker.next(WAIT_S)
    assert delivered is not None
    assert delivered.value == sent
    assert delivered.via == "express", "the express copy should win on an idle machine"
    log = RedisDeliveryLog(kit.infra.redis_url, kit.names)
    kit.closer.add(log)
    assert await log.begin(sent.batch_id) == 2, "the push counted the express delivery (this is the second)"
    assert await worker.next(1.0) is None, "the Kafka copy of a batch that ran must not come again"
    await worker.commit(delivered)  # waits for the Kafka copy, commits its offset
    await worker.close()

    later = batch("b2")
    await producer.send(later, 0)
    replacement = await kit.consumer("w2")  # another worker: gets only what Kafka still holds
    resumed = await replacement.next(WAIT_S)
    assert resumed is not None
    assert resumed.value == later, f"b1 was committed; expected b2 next, got {resumed.value}"
    assert resumed.partition == 0


async def test_a_batch_for_an_idle_worker_lands_on_kafka_after_its_copy_by_the_delay(kit: Kit) -> None:
    worker = await kit.consumer()
    producer = await kit.producer(record_delay_s=1.0)
    started = time.monotonic()
    sending = asyncio.ensure_future(producer.send(batch("idle-1"), 0, idle_worker=True))
    delivered = await worker.next(WAIT_S)
    assert delivered is not None and delivered.via == "express"
    assert not sending.done(), "the Kafka record waits for the delay"
    await sending
    assert time.monotonic() - started >= 1.0
    await worker.commit(delivered)  # the record is there now: its offset commits

    started = time.monotonic()
    await producer.send(batch("busy-1"), 0)
    assert time.monotonic() - started < 1.0, "a batch for a busy worker lands at once"
    delivered = await worker.next(WAIT_S)
    assert delivered is not None and delivered.value is not None and delivered.value.batch_id == "busy-1"
    await worker.commit(delivered)


async def test_an_express_copy_that_comes_after_the_kafka_copy_is_dropped(kit: Kit) -> None:
    worker = await kit.consumer()
    kafka = KafkaBatchProducer(kit.infra.kafka_bootstrap, kit.names)
    await kafka.start()
    kit.closer.add(kafka)
    sent = batch("b1")
    await kafka.send(sent, 0)  # Kafka only, first

    delivered = await worker.next(WAIT_S)
    assert delivered is not None
    assert (delivered.value, delivered.partition) == (sent, 0)
    express = kit.express()
    kit.closer.add(express)
    assert await express.push("w1", encode_batch(sent), sent.batch_id, [item.task_id for item in sent.items])
    assert await worker.next(1.0) is None, "a batch must run once, whichever copy comes first"
    await worker.commit(delivered)


async def express_only(kit: Kit, worker: ExpressBatchConsumer, ids: list[str]) -> list[Delivered[Batch]]:
    """Pushes batches to the worker's express list alone (their Kafka records never come) and reads them."""
    express = kit.express()
    kit.closer.add(express)
    got = []
    for batch_id in ids:
        sent = batch(batch_id)
        assert await express.push("w1", encode_batch(sent), batch_id, [item.task_id for item in sent.items])
        delivered = await worker.next(WAIT_S)
        assert delivered is not None and delivered.via == "express"
        got.append(delivered)
    return got


class CountingExpress(RedisExpress):
    """Real express lists; counts the worker's BLPOPs in flight."""

    armed = 0

    async def pop(self, worker_id: str, timeout_s: float) -> bytes | None:
        self.armed += 1
        try:
            return await super().pop(worker_id, timeout_s)
        finally:
            self.armed -= 1


async def test_a_reader_that_got_a_batch_pops_again_once_the_worker_asks_while_the_other_stays_armed(
    kit: Kit,
) -> None:
    """Nothing is sent between a batch's arrival and its call's start, and a pop stays armed, even
    when two batches come before the worker asks."""
    counting = CountingExpress(kit.infra.redis_url, kit.names)
    worker = await kit.consumer(express=counting)
    await eventually(lambda: counting.armed == 2, "both readers to wait on the list", timeout_s=WAIT_S)
    pusher = kit.express()
    kit.closer.add(pusher)
    redis = kit.redis()

    first = batch("b1")
    assert await pusher.push("w1", encode_batch(first), "b1", [item.task_id for item in first.items])
    await eventually(lambda: counting.armed == 1, "a reader to take b1", timeout_s=WAIT_S)
    for _ in range(20):  # turns of the loop and round trips in which a reader that pops on would send its BLPOP
        await asyncio.sleep(0)
        await redis.ping()
    assert counting.armed == 1, "the reader that got b1 pops again only once the worker asks"

    # The worker has not asked yet: the other reader takes b2 at once and, the first one waiting for
    # an ask, pops again at once, so b3 is taken too.
    for name in ("b2", "b3"):
        more = batch(name)
        assert await pusher.push("w1", encode_batch(more), name, [item.task_id for item in more.items])
    await eventually(lambda: worker.queued == 3, "b2 and b3 to be taken before any ask", timeout_s=WAIT_S)
    assert await redis.llen(kit.names.express_list("w1")) == 0
    await eventually(lambda: counting.armed == 1, "one reader to stay armed", timeout_s=WAIT_S)

    got = [await worker.next(WAIT_S) for _ in range(3)]
    assert [(d.value.batch_id, d.via) for d in got if d is not None and d.value is not None] == [
        ("b1", "express"),
        ("b2", "express"),
        ("b3", "express"),
    ]
    await eventually(lambda: counting.armed == 2, "both readers to pop again once the worker asked", timeout_s=WAIT_S)


async def test_the_express_list_is_popped_while_kafka_batches_wait_in_the_queue(kit: Kit) -> None:
    """A reader that popped only once the queue ran dry would leave express copies to their records
    while Kafka's read-ahead keeps it full: each run as a second delivery, carefully."""
    worker = await kit.consumer()
    kafka = KafkaBatchProducer(kit.infra.kafka_bootstrap, kit.names)
    await kafka.start()
    kit.closer.add(kafka)
    for batch_id in ("k1", "k2", "k3"):
        await kafka.send(batch(batch_id), 0)  # Kafka only
    await eventually(lambda: worker.queued == 3, "the Kafka batches to wait in the queue", timeout_s=WAIT_S)
    express = kit.express()
    kit.closer.add(express)
    sent = batch("e1")
    assert await express.push("w1", encode_batch(sent), "e1", [item.task_id for item in sent.items])

    first = await worker.next(WAIT_S)
    assert first is not None and first.via == "kafka"
    await eventually(lambda: worker.queued == 3, "the express batch to be popped while Kafka's wait", timeout_s=WAIT_S)
    assert await kit.redis().llen(kit.names.express_list("w1")) == 0
    got = [await worker.next(WAIT_S) for _ in range(3)]
    assert [(d.value.batch_id, d.via) for d in got if d is not None and d.value is not None] == [
        ("k2", "kafka"),
        ("k3", "kafka"),
        ("e1", "express"),
    ]


async def test_express_batches_whose_records_are_late_together_wait_for_them_once(kit: Kit) -> None:
    """A broker's failover holds up many records at once: their commits wait out one timeout, not one each."""
    worker = await kit.consumer(confirm_timeout_s=1.0)
    got = await express_only(kit, worker, ["b1", "b2", "b3", "b4"])
    started = time.monotonic()
    for delivered in got:
        await worker.commit(delivered)
    assert time.monotonic() - started < 2.5, "each commit waited its own timeout for a record that is late"


async def test_a_rebalance_ends_the_wait_for_an_express_batchs_record(kit: Kit) -> None:
    """The record may go to the partition's next owner: the batch is not waited for (nor committed) here."""
    worker = await kit.consumer()
    (delivered,) = await express_only(kit, worker, ["b1"])
    committing = asyncio.ensure_future(worker.commit(delivered))
    await kit.consumer("w2", owns=False)  # joins the group: w1's partition is revoked
    await asyncio.wait_for(committing, WAIT_S / 2)


async def test_a_batch_holding_a_task_that_ended_is_not_pushed(kit: Kit) -> None:
    store = RedisTaskStore(kit.infra.redis_url, kit.names)
    await store.start()
    kit.closer.add(store)
    express = kit.express()
    kit.closer.add(express)
    sent = batch("b1")
    now = int(time.time() * 1000)
    await store.create(TaskState("b1-0", TaskStatus.QUEUED, MODEL, now, now))
    cancelled = await store.cancel("b1-0", "cancelled", "cancelled while it waited")
    assert cancelled is not None and cancelled.status is TaskStatus.CANCELLED
    pushed = await express.push("idle-w", encode_batch(sent), sent.batch_id, ["b1-0"])
    assert pushed is False, "a batch with a cancelled task must not reach an idle worker's list"
    assert await express.pop("idle-w", 0.1) is None
    log = RedisDeliveryLog(kit.infra.redis_url, kit.names)
    kit.closer.add(log)
    assert await log.begin(sent.batch_id) == 1, "no delivery was counted for a batch not pushed"


async def test_a_batch_kafka_refuses_is_taken_back_from_the_express_list(kit: Kit) -> None:
    producer = await kit.producer()
    await producer.kafka.close()  # Kafka now refuses every send

    with pytest.raises(Exception, match="not started"):
        await producer.send(batch("b1", worker="idle-nobody-pops"), 0)
    express = kit.express()
    kit.closer.add(express)
    assert await express.pop("idle-nobody-pops", 0.1) is None, "the refused batch stayed on the express list"


async def test_a_restarted_worker_clears_what_its_list_held(kit: Kit) -> None:
    express = kit.express()
    kit.closer.add(express)
    assert await express.push("w1", encode_batch(batch("stale")), "stale", ["stale-0"])

    worker = await kit.consumer()
    assert await worker.next(1.0) is None, "a stale express batch ran; its Kafka copy is the one to run"


# requests: gateway -> batcher ------------------------------------------------------------------


def request_consumer(kit: Kit) -> ExpressRequestConsumer:
    return ExpressRequestConsumer(
        KafkaRequestConsumer(kit.infra.kafka_bootstrap, kit.names, timing=GroupTiming(heartbeat_interval_ms=500)),
        kit.infra.redis_url,
        kit.names,
    )


async def start_request_consumer(kit: Kit, partitions: int) -> ExpressRequestConsumer:
    consumer = request_consumer(kit)
    owned: set[int] = set()

    async def assigned(parts: frozenset[int]) -> None:
        owned.update(parts)

    async def revoked(parts: frozenset[int]) -> None:
        owned.difference_update(parts)

    await consumer.start(assigned, revoked)
    await eventually(lambda: len(owned) == partitions, "the batcher to own every request partition", timeout_s=WAIT_S)
    return consumer


async def request_producer(kit: Kit, partitions: int, record_delay_s: float = 0.0) -> ExpressRequestProducer:
    kafka = KafkaRequestProducer(kit.infra.kafka_bootstrap, kit.names, Partitioner((MODEL,), partitions))
    producer = ExpressRequestProducer(kafka, kit.express(), record_delay_s=record_delay_s)
    await producer.start()
    return kit.closer.add(producer)  # type: ignore[no-any-return]


def request(task_id: str) -> InferenceRequest:
    now = int(time.time() * 1000)
    return InferenceRequest(task_id, MODEL, "input", now, now + 30_000, "g1")


async def test_a_request_comes_as_an_express_copy_and_as_its_kafka_record(kit: Kit) -> None:
    await ensure_topics(kit.infra.kafka_bootstrap, {kit.names.request_topic: 2})
    consumer = kit.closer.add(await start_request_consumer(kit, 2))
    producer = await request_producer(kit, 2)
    sent = request("t1")
    await producer.send(sent)

    got: list[Delivered[InferenceRequest]] = []
    async with asyncio.timeout(WAIT_S):
        while len(got) < 2:
            got.extend(await consumer.fetch(1.0, 100))
    assert [d.value for d in got] == [sent, sent]
    assert sorted(d.via == "express" for d in got) == [False, True], f"one copy and one record, got {got}"
    assert got[0].partition == got[1].partition


async def test_a_synchronous_requests_record_is_produced_after_its_copy_by_the_delay(kit: Kit) -> None:
    await ensure_topics(kit.infra.kafka_bootstrap, {kit.names.request_topic: 1})
    consumer = kit.closer.add(await start_request_consumer(kit, 1))
    producer = await request_producer(kit, 1, record_delay_s=1.0)
    started = time.monotonic()
    sending = asyncio.ensure_future(producer.send(request("t1")))
    got: list[Delivered[InferenceRequest]] = []
    async with asyncio.timeout(WAIT_S):
        while not got:
            got.extend(await consumer.fetch(1.0, 100))
    assert [d.via for d in got] == ["express"], f"the copy comes alone first, got {got}"
    assert not sending.done(), "the record waits for the delay"
    await sending
    assert time.monotonic() - started >= 1.0
    async with asyncio.timeout(WAIT_S):
        while len(got) < 2:
            got.extend(await consumer.fetch(1.0, 100))
    assert got[1].via == "kafka" and got[1].value == got[0].value

    acknowledged = replace(request("t2"), reply_to=None)  # POST /v1/tasks: its 202 waits for the record
    started = time.monotonic()
    await producer.send(acknowledged)
    assert time.monotonic() - started < 1.0, "an acknowledged submit (no reply_to) is not delayed"


async def test_the_batcher_batches_a_request_once_and_commits_its_record(kit: Kit) -> None:
    await ensure_topics(kit.infra.kafka_bootstrap, {kit.names.request_topic: 1})
    consumer = request_consumer(kit)
    batches = MemoryBatchBus(1)
    credits = MemoryCreditPool()
    batcher = Batcher(BatcherSettings(models=(MODEL,)), consumer, batches, credits, MemoryTaskStore())
    await batcher.start()
    try:
        await eventually(
            lambda: consumer.assignment() == {0}, "the batcher to own the request partition", timeout_s=WAIT_S
        )
        worker = batches.consumer(0)
        now = int(time.time() * 1000)
        await credits.offer(Credit("w1", MODEL, 0, 1, now, now + 60_000, max_batch=100))
        await credits.offer(Credit("w2", MODEL, 0, 1, now, now + 60_000, max_batch=100))
        producer = await request_producer(kit, 1)
        sent = request("t1")
        await producer.send(sent)

        delivered = await worker.next(WAIT_S)
        assert delivered is not None and delivered.value is not None
        assert [item.task_id for item in delivered.value.items] == ["t1"]
        await eventually(
            lambda: batcher.offsets.committed_at(0) == 1, "the request's offset to be committed", timeout_s=20
        )
        assert await worker.next(1.0) is None, "the request was batched twice (copy and record)"
    finally:
        await batcher.close()

    again = KafkaRequestConsumer(kit.infra.kafka_bootstrap, kit.names, timing=GroupTiming(heartbeat_interval_ms=500))
    kit.closer.add(again)
    await again.start(nothing, nothing)
    records: list[Delivered[InferenceRequest]] = []
    async with asyncio.timeout(WAIT_S):
        while not again.assignment():
            records.extend(await again.fetch(0.2, 100))
    records.extend(await again.fetch(1.0, 100))
    assert records == [], "the request's offset was not committed after its batch went out"


async def nothing(partitions: frozenset[int]) -> None:
    return None
