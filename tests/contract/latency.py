"""Per-operation latency of the Redis and Kafka transports on loopback (a measurement, not a test).

    python -m tests.contract.latency            # Kafka and Redis from infra.select (local stack)
    BATCHWIRE_TEST_INFRA=external BATCHWIRE_TEST_KAFKA_BOOTSTRAP=... BATCHWIRE_TEST_REDIS_URL=... \\
        python -m tests.contract.latency

Prints p50/p90/p99 per operation; the Kafka part repeats produce->consume for several broker
fetch waits to show that the wait does not add latency.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence

from schemas.records import Credit, InferenceRequest, TaskState, TaskStatus
from schemas.wire import Names
from transport.kafka.consumers import KafkaRequestConsumer
from transport.kafka.group import GroupTiming
from transport.kafka.producers import KafkaRequestProducer
from transport.redis.credits import RedisCreditPool
from transport.redis.store import RedisTaskStore
from transport.routing import Partitioner


def summary(name: str, samples: Sequence[float]) -> None:
    ordered = sorted(samples)
    count = len(ordered)

    def at(fraction: float) -> float:
        return ordered[min(count - 1, int(count * fraction))] * 1000

    print(f"{name:<34} p50 {at(0.5):7.3f} ms  p90 {at(0.9):7.3f} ms  p99 {at(0.99):7.3f} ms  (n={count})")


def wall_ms() -> int:
    return int(time.time() * 1000)


def task(task_id: str, status: TaskStatus) -> TaskState:
    return TaskState(task_id, status, "m", wall_ms(), wall_ms(), output="x" * 100, reply_to="g1")


async def redis_latency(redis_url: str, rounds: int = 1000) -> None:
    names = Names(f"lat{uuid.uuid4().hex[:8]}")
    store = RedisTaskStore(redis_url, names)
    pool = RedisCreditPool(redis_url, names)
    await store.start()
    await pool.start()
    try:
        samples: list[float] = []
        for index in range(rounds):
            started = time.perf_counter()
            await store.create(task(f"c{index}", TaskStatus.QUEUED))
            samples.append(time.perf_counter() - started)
        summary("create", samples)

        samples = []
        for index in range(rounds // 10):
            updates = [task(f"a{index}-{item}", TaskStatus.COMPLETED) for item in range(100)]
            started = time.perf_counter()
            await store.apply(updates)
            samples.append(time.perf_counter() - started)
        summary("apply(100 terminal updates)", samples)

        samples = []
        for index in range(rounds // 10):
            ids = [f"a{index}-{item}" for item in range(100)]
            started = time.perf_counter()
            await store.get_many(ids)
            samples.append(time.perf_counter() - started)
        summary("get_many(100)", samples)

        samples = []
        for index in range(rounds // 4):
            async with store.watch(f"w{index}") as events:
                started = time.perf_counter()
                await store.apply([task(f"w{index}", TaskStatus.RUNNING)])
                await anext(events)
                samples.append(time.perf_counter() - started)
        summary("apply -> watcher sees it", samples)

        offers: list[float] = []
        claims: list[float] = []
        for index in range(rounds):
            credit = Credit("w1", "m", 0, index, wall_ms(), wall_ms() + 60_000)
            started = time.perf_counter()
            await pool.offer(credit)
            offers.append(time.perf_counter() - started)
            started = time.perf_counter()
            await pool.claim("m", 1.0)
            claims.append(time.perf_counter() - started)
        summary("offer", offers)
        summary("claim (a credit waits)", claims)
    finally:
        await pool.close()
        await store.close()


async def kafka_latency(bootstrap: str, fetch_max_wait_ms: int, rounds: int = 300) -> None:
    from infra.topics import ensure_topics

    names = Names(f"lat{uuid.uuid4().hex[:8]}")
    await ensure_topics(bootstrap, {names.request_topic: 4})
    producer = KafkaRequestProducer(bootstrap, names, Partitioner(["m"], 4))
    consumer = KafkaRequestConsumer(bootstrap, names, timing=GroupTiming(fetch_max_wait_ms=fetch_max_wait_ms))
    assigned = asyncio.Event()

    async def on_assigned(partitions: frozenset[int]) -> None:
        if partitions:
            assigned.set()

    async def on_revoked(partitions: frozenset[int]) -> None:
        return None

    await producer.start()
    await consumer.start(on_assigned, on_revoked)
    try:
        await asyncio.wait_for(assigned.wait(), 30)
        await consumer.fetch(0.5, 10)
        sends: list[float] = []
        trips: list[float] = []
        for index in range(rounds):
            request = InferenceRequest(f"t{index}", "m", "x" * 200, wall_ms(), wall_ms() + 30_000)
            fetching = asyncio.create_task(consumer.fetch(5.0, 10))
            await asyncio.sleep(0.003)  # the consumer sits idle in a fetch, as between requests
            started = time.perf_counter()
            await producer.send(request)
            sends.append(time.perf_counter() - started)
            while not await fetching:
                fetching = asyncio.create_task(consumer.fetch(5.0, 10))
            trips.append(time.perf_counter() - started)
        summary(f"send, acked (wait {fetch_max_wait_ms} ms)", sends)
        summary(f"produce -> consume (wait {fetch_max_wait_ms} ms)", trips)
    finally:
        await consumer.close()
        await producer.close()


async def main(bootstrap: str, redis_url: str) -> None:
    await redis_latency(redis_url)
    for fetch_max_wait_ms in (5, 20, 100, 500):
        await kafka_latency(bootstrap, fetch_max_wait_ms)


if __name__ == "__main__":
    from infra.select import provide_infra

    with provide_infra() as provided:
        asyncio.run(main(provided.kafka_bootstrap, provided.redis_url))
