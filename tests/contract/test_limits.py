"""RateLimiter and QueueDepth contracts, in memory and over the real Redis and Kafka (the limiter over a
Redis Cluster too).

Each ``make_limiter`` call is one gateway's limiter: over Redis a new client, so two of them must
share one bucket per client; in memory the one process has one limiter.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from schemas.records import InferenceRequest
from schemas.wire import Names
from telemetry.metrics import REGISTRY
from tests.support.eventually import eventually
from tests.support.reply_cutter import ReplyCutter
from tests.support.transport_kits import MODELS, REQUEST_PARTITIONS, Closer, RequestBusKit, ensure_topics
from transport.kafka.lag import KafkaQueueDepth
from transport.memory.lag import MemoryQueueDepth
from transport.memory.limits import MemoryRateLimiter
from transport.ports import QueueDepth, RateLimiter
from transport.redis.limits import RedisRateLimiter, bucket_id

pytestmark = pytest.mark.timeout(60)

LimiterFactory = Callable[[float, int], Awaitable[RateLimiter]]


@pytest.fixture
async def make_limiter(keyed_url: str | None, names: Names) -> AsyncIterator[LimiterFactory]:
    closer = Closer()
    shared: list[RateLimiter] = []

    async def make(rate_per_s: float, burst: int) -> RateLimiter:
        limiter: RateLimiter
        if keyed_url is not None:
            limiter = RedisRateLimiter(keyed_url, names, rate_per_s, burst)
        elif shared:
            return shared[0]
        else:
            limiter = MemoryRateLimiter(rate_per_s, burst)
            shared.append(limiter)
        await limiter.start()
        return closer.add(limiter)  # type: ignore[no-any-return]

    yield make
    await closer.close_all()


async def test_a_burst_is_granted_then_the_next_waits_for_a_token(make_limiter: LimiterFactory) -> None:
    limiter = await make_limiter(2.0, 3)
    started = time.monotonic()
    waits = [await limiter.acquire("client-a") for _ in range(3)]
    assert waits == [0.0, 0.0, 0.0], f"a full bucket grants its burst at once, got {waits}"

    refused = await limiter.acquire("client-a")
    elapsed = time.monotonic() - started  # the bucket refills while the burst is taken
    assert 0.5 - elapsed - 0.05 < refused <= 0.5 + 0.05, (
        f"at 2/s the next token is 0.5 s after the burst ({elapsed:.3f} s ago), got {refused}"
    )
    again = await limiter.acquire("client-a")
    assert again > 0, "a refused request takes no token, so the next is refused too"


async def test_tokens_come_back_at_the_rate(make_limiter: LimiterFactory) -> None:
    limiter = await make_limiter(10.0, 1)
    assert await limiter.acquire("c") == 0.0
    started = time.monotonic()
    while await limiter.acquire("c") > 0:  # poll with a deadline: the refill is what is tested
        assert time.monotonic() - started < 5, "no token came back within 5 s at 10/s"
        await asyncio.sleep(0.01)
    elapsed = time.monotonic() - started
    assert 0.05 <= elapsed < 1.0, f"a token comes back after about 0.1 s at 10/s, took {elapsed:.3f} s"


async def test_two_gateways_share_one_bucket_per_client(make_limiter: LimiterFactory) -> None:
    first = await make_limiter(0.5, 4)
    second = await make_limiter(0.5, 4)
    granted = [await (first if i % 2 else second).acquire("shared") for i in range(4)]
    assert granted == [0.0] * 4
    assert await first.acquire("shared") > 0, "the bucket is shared: four taken through two gateways empty it"
    assert await second.acquire("shared") > 0
    assert await second.acquire("someone-else") == 0.0, "each client has a bucket of its own"


async def test_concurrent_takers_never_get_more_than_the_burst(make_limiter: LimiterFactory) -> None:
    limiters = [await make_limiter(0.1, 10) for _ in range(3)]
    waits = await asyncio.gather(*(limiters[i % 3].acquire("crowd") for i in range(60)))
    assert sum(1 for wait in waits if wait == 0.0) == 10, f"exactly the burst may pass, got {waits}"


@pytest.mark.kafka
async def test_redis_buckets_expire_once_full_again(redis_url: str, names: Names) -> None:
    limiter = RedisRateLimiter(redis_url, names, 100.0, 5)
    raw = Redis.from_url(redis_url)
    try:
        await limiter.acquire("brief")
        ttl_ms = await raw.pttl(names.rate_bucket(bucket_id("brief")))
        assert 0 < ttl_ms <= 1000 + 20, f"a bucket one token short refills in 10 ms (+1 s margin), pttl {ttl_ms}"
    finally:
        await raw.aclose()
        await limiter.close()


async def test_a_token_whose_reply_was_lost_is_taken_once(redis_url: str, names: Names) -> None:
    """The connection drops after Redis ran the script: redis-py's retry runs it again on a new one,
    which must not take (or, for a refund, give back) the tokens a second time."""
    cutter = ReplyCutter(redis_url)
    limiter = RedisRateLimiter(await cutter.start(), names, 0.001, 10)
    raw = Redis.from_url(redis_url)
    key = names.rate_bucket(bucket_id("lossy"))
    try:
        await limiter.start()
        await limiter.acquire("warm")  # a connection open and the script loaded: the next reply is the call's
        cutter.cut_next()
        taken = await limiter.acquire("lossy", 3)
        after_take = float(await raw.hget(key, "tokens") or 0)
        cutter.cut_next()
        await limiter.acquire("lossy", -2)
        after_refund = float(await raw.hget(key, "tokens") or 0)
    finally:
        await raw.aclose()
        await limiter.close()
        await cutter.close()
    assert cutter.cuts == 2, f"both replies were lost, {cutter.cuts} were"
    assert taken == 0, f"the tokens were there, yet the call waits {taken} s"
    assert after_take == pytest.approx(7, abs=0.1), f"3 of 10 tokens taken once leave 7, the bucket holds {after_take}"
    assert after_refund == pytest.approx(9, abs=0.1), f"2 given back once make 9, the bucket holds {after_refund}"


# queue depth --------------------------------------------------------------------------------------


def _request(index: int) -> InferenceRequest:
    now = int(time.time() * 1000)
    return InferenceRequest(f"r{index}", MODELS[index % 2], f"input {index}", now, now + 60_000)


@pytest.fixture
async def queue_depth(request_bus: RequestBusKit) -> AsyncIterator[QueueDepth]:
    depth: QueueDepth
    if request_bus.memory is not None:
        depth = MemoryQueueDepth(request_bus.memory)
    else:
        assert request_bus.bootstrap is not None
        depth = KafkaQueueDepth(request_bus.bootstrap, request_bus.names, REQUEST_PARTITIONS, refresh_s=0.05)
    await depth.start()
    yield depth
    await depth.close()


async def _depth_becomes(depth: QueueDepth, expected: int, what: str) -> None:
    last = [-1]

    async def probe() -> None:
        last[0] = await depth.depth()

    deadline = time.monotonic() + 20
    while True:
        await probe()
        if last[0] == expected:
            return
        assert time.monotonic() < deadline, f"{what}: depth stayed {last[0]}, expected {expected}"
        await asyncio.sleep(0.02)


def _lag_gauge() -> float | None:
    return REGISTRY.get_sample_value("batchwire_request_topic_lag")


async def test_depth_counts_requests_not_yet_committed_by_a_batcher(
    request_bus: RequestBusKit, queue_depth: QueueDepth
) -> None:
    # Unknown (None) until a first read succeeds: on a fresh cluster the group's coordinator comes later.
    await _depth_becomes(queue_depth, 0, "an empty topic")
    producer = await request_bus.producer()
    for index in range(7):
        await producer.send(_request(index))
    await _depth_becomes(queue_depth, 7, "after 7 requests produced")
    assert _lag_gauge() == 7, "the lag gauge follows the depth"

    consumer = request_bus.consumer()
    assigned = asyncio.Event()

    async def on_assigned(_: frozenset[int]) -> None:
        assigned.set()

    async def on_revoked(_: frozenset[int]) -> None:
        return None

    await consumer.start(on_assigned, on_revoked)
    await asyncio.wait_for(assigned.wait(), 20)
    fetched: list[Any] = []
    deadline = time.monotonic() + 20
    while len(fetched) < 7:
        assert time.monotonic() < deadline, f"fetched only {len(fetched)} of 7"
        fetched.extend(await consumer.fetch(timeout_s=0.5, max_records=100))
    await _depth_becomes(queue_depth, 7, "fetched but not committed")

    # commit what was fetched from one partition only: those leave the queue, the rest stay
    partition = fetched[0].partition
    on_partition = [record for record in fetched if record.partition == partition]
    await consumer.commit({partition: max(record.offset for record in on_partition) + 1})
    await _depth_becomes(queue_depth, 7 - len(on_partition), "after committing one partition")

    offsets: dict[int, int] = {}
    for record in fetched:
        offsets[record.partition] = max(offsets.get(record.partition, 0), record.offset + 1)
    await consumer.commit(offsets)
    await _depth_becomes(queue_depth, 0, "after committing everything")


@pytest.mark.kafka
async def test_kafka_depth_is_refreshed_in_the_background(kafka_bootstrap: str, names: Names) -> None:
    """``depth()`` never reads Kafka itself; the owned task keeps the cached figure fresh."""
    from transport.kafka.producers import KafkaRequestProducer
    from transport.routing import Partitioner

    await ensure_topics(kafka_bootstrap, {names.request_topic: REQUEST_PARTITIONS})
    depth = KafkaQueueDepth(kafka_bootstrap, names, REQUEST_PARTITIONS, refresh_s=0.05)
    producer = KafkaRequestProducer(kafka_bootstrap, names, Partitioner(MODELS, REQUEST_PARTITIONS))
    await depth.start()
    await producer.start()
    try:
        assert depth.alive
        calls = 0
        original = depth.refresh

        async def counting() -> int:
            nonlocal calls
            calls += 1
            return await original()

        depth.refresh = counting  # type: ignore[method-assign]
        for index in range(3):
            await producer.send(_request(index))
        await eventually(lambda: calls >= 2, "two background refreshes", timeout_s=20)
        await _depth_becomes(depth, 3, "after 3 requests")
        before = calls
        for _ in range(1000):
            await depth.depth()
        assert calls - before < 50, "depth() must read the cache, not Kafka"
    finally:
        await producer.close()
        await depth.close()
    assert not depth.alive, "close() stops the refresher"


@pytest.mark.kafka
async def test_kafka_depth_of_an_unreachable_broker_fails_start(names: Names) -> None:
    depth = KafkaQueueDepth("127.0.0.1:1", names, 2, refresh_s=0.05, request_timeout_ms=500)
    with pytest.raises(Exception, match=r"127\.0\.0\.1:1"):
        await depth.start()
    assert not depth.alive


async def test_a_request_of_several_inputs_takes_its_tokens_at_once_or_none(make_limiter: LimiterFactory) -> None:
    limiter = await make_limiter(1.0, 5)
    assert await limiter.acquire("c", 3) == 0.0
    short = await limiter.acquire("c", 3)
    assert 0.9 < short <= 1.05, f"2 tokens left: the third comes in about 1 s at 1/s, got {short}"
    assert await limiter.acquire("c", 2) == 0.0, "the refused request took none of the 2 left"
    assert await limiter.acquire("c") > 0
    assert await limiter.acquire("c", -2) == 0.0, "a request refused whole gives its 2 back"
    assert await limiter.acquire("c", 2) == 0.0
    assert await limiter.acquire("c", -9) == 0.0
    assert await limiter.acquire("c", 6) > 0, "given back up to the burst of 5, no more"


@pytest.mark.kafka
async def test_a_models_missing_batch_topic_leaves_the_other_models_batch_counts_read(
    kafka_bootstrap: str, names: Names
) -> None:
    """Admission reads a model whose batch count stops growing as stalled (its workers hung or
    gone): one model's batch topic that does not exist yet must not stop the others' counts, nor hold
    every refresh for the lookup's timeout."""
    from transport.kafka.producers import KafkaBatchProducer

    served, missing = MODELS
    await ensure_topics(kafka_bootstrap, {names.request_topic: REQUEST_PARTITIONS, names.batch_topic(served): 2})
    depth = KafkaQueueDepth(
        kafka_bootstrap, names, REQUEST_PARTITIONS, refresh_s=0.05, models=MODELS, count_batches=True
    )
    producer = KafkaBatchProducer(kafka_bootstrap, names)
    await depth.start()
    await producer.start()
    try:
        for partition in (0, 1, 1):
            await producer.send_encoded(served, b"a batch", partition)
        started = time.monotonic()
        await depth.refresh()
        assert time.monotonic() - started < 1.0, f"a refresh waited on {names.batch_topic(missing)}, which is missing"
        backlog = depth.backlog(served)
        assert backlog is not None and backlog.batches == 3
        await ensure_topics(kafka_bootstrap, {names.batch_topic(missing): 2})
        await producer.send_encoded(missing, b"a batch", 0)

        def counted() -> bool:
            later = depth.backlog(missing)
            return later is not None and later.batches == 1

        await eventually(counted, f"a batch on {names.batch_topic(missing)}, created after start", timeout_s=40)
    finally:
        await producer.close()
        await depth.close()


@pytest.mark.kafka
async def test_batches_on_partitions_added_by_topics_grow_are_counted(kafka_bootstrap: str, names: Names) -> None:
    """``topics grow --batch-partitions`` is live and a running gateway keeps its ``--batch-partitions``:
    a batch that a worker owning a new partition takes must count all the same, or admission reads a
    model served by that worker alone as stalled (no batch for ``stall_s``) and refuses it."""
    from infra.topics import grow_topics
    from transport.kafka.producers import KafkaBatchProducer

    model = MODELS[0]
    await ensure_topics(kafka_bootstrap, {names.request_topic: REQUEST_PARTITIONS, names.batch_topic(model): 1})
    depth = KafkaQueueDepth(
        kafka_bootstrap, names, REQUEST_PARTITIONS, refresh_s=0.05, models=MODELS, count_batches=True
    )
    await depth.start()
    try:
        await grow_topics(kafka_bootstrap, {names.batch_topic(model): 2})
        producer = KafkaBatchProducer(kafka_bootstrap, names)  # started after the grow: it knows partition 1
        await producer.start()
        try:
            await producer.send_encoded(model, b"a batch", 1)
        finally:
            await producer.close()

        def counted() -> bool:
            backlog = depth.backlog(model)
            return backlog is not None and backlog.batches == 1

        # the reader's metadata learns of the new partition within METADATA_MAX_AGE_MS (10 s)
        await eventually(
            counted, f"the batch on partition 1 of {names.batch_topic(model)}, added by a grow", timeout_s=40
        )
    finally:
        await depth.close()
