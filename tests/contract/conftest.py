"""Contract-test kits: each transport built either in memory or over the real Kafka and Redis.

Every test that takes ``kind`` runs twice, so the in-memory transports (embedded mode, unit tests)
are held to the same contract as the Kafka and Redis ones. Real infrastructure comes from the
session fixture ``infra`` (tests/conftest.py); ``names`` gives every test its own topics and keys.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from schemas.wire import Names
from transport.kafka.consumers import KafkaBatchConsumer, KafkaRequestConsumer
from transport.kafka.producers import KafkaBatchProducer, KafkaRequestProducer
from transport.memory.bus import MemoryBatchBus, MemoryCreditPool, MemoryRequestBus, MemoryTaskStore
from transport.ports import (
    BatchConsumer,
    BatchProducer,
    CreditPool,
    RequestConsumer,
    RequestProducer,
    TaskStore,
)
from transport.redis.store import RedisCreditPool, RedisTaskStore
from transport.routing import Partitioner

REAL = "real"
MODELS = ("alpha", "beta")
REQUEST_PARTITIONS = 4
BATCH_PARTITIONS = 2


@pytest.fixture(params=["memory", pytest.param(REAL, marks=pytest.mark.kafka)])
def kind(request: pytest.FixtureRequest) -> str:
    """``memory`` or ``real`` (Kafka and Redis from the session's ``infra``)."""
    return str(request.param)


@pytest.fixture
def real_infra(kind: str, request: pytest.FixtureRequest) -> Any:
    """The session's infrastructure when ``kind`` is real (resolved here, outside the event loop)."""
    return request.getfixturevalue("infra") if kind == REAL else None


@pytest.fixture
def redis_url(request: pytest.FixtureRequest) -> str:
    """For tests of the Redis transports alone."""
    return str(request.getfixturevalue("infra").redis_url)


@pytest.fixture
def kafka_bootstrap(request: pytest.FixtureRequest) -> str:
    """For tests of the Kafka transports alone."""
    return str(request.getfixturevalue("infra").kafka_bootstrap)


async def ensure_topics(bootstrap: str, topics: dict[str, int]) -> None:
    from infra.topics import ensure_topics as create

    await create(bootstrap, topics)


async def eventually(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Polls ``check`` until true; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


class Closer:
    """Closes what a test started, newest first, even when the test failed."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def add(self, item: Any) -> Any:
        self.items.append(item)
        return item

    async def close_all(self) -> None:
        while self.items:
            await self.items.pop().close()


# Task store ---------------------------------------------------------------------------------------

StoreFactory = Callable[..., Awaitable[TaskStore]]


@pytest.fixture
async def make_store(kind: str, real_infra: Any, names: Names) -> AsyncIterator[StoreFactory]:
    """Each call is one process's view of the store: a new Redis client, or the one shared memory store."""
    closer = Closer()
    shared: list[MemoryTaskStore] = []

    async def make(ttl_s: float = 3600.0) -> TaskStore:
        if kind != REAL and shared:
            return shared[0]
        store: TaskStore
        if kind == REAL:
            store = RedisTaskStore(real_infra.redis_url, names, ttl_s=ttl_s)
        else:
            shared.append(MemoryTaskStore(ttl_s=ttl_s))
            store = shared[0]
        await store.start()
        return closer.add(store)  # type: ignore[no-any-return]

    yield make
    await closer.close_all()


# Credit pool --------------------------------------------------------------------------------------

PoolFactory = Callable[[], Awaitable[CreditPool]]


@pytest.fixture
async def make_pool(kind: str, real_infra: Any, names: Names) -> AsyncIterator[PoolFactory]:
    """Each call is one process's view of the pool: a new Redis client, or the one shared memory pool."""
    closer = Closer()
    shared = MemoryCreditPool()

    async def make() -> CreditPool:
        pool: CreditPool = RedisCreditPool(real_infra.redis_url, names) if kind == REAL else shared
        await pool.start()
        if kind == REAL or not closer.items:
            closer.add(pool)
        return pool

    yield make
    await closer.close_all()


# Request bus --------------------------------------------------------------------------------------


@dataclass
class RequestBusKit:
    kind: str
    names: Names
    partitioner: Partitioner
    bootstrap: str | None
    closer: Closer = field(default_factory=Closer)
    memory: MemoryRequestBus | None = None

    async def producer(self) -> RequestProducer:
        producer: RequestProducer
        if self.memory is not None:
            producer = self.memory.producer()
        else:
            assert self.bootstrap is not None
            producer = KafkaRequestProducer(self.bootstrap, self.names, self.partitioner)
        await producer.start()
        return self.closer.add(producer)  # type: ignore[no-any-return]

    def consumer(self) -> RequestConsumer:
        """Not started: the test starts it with its own callbacks (and closes it, or leaves it to teardown)."""
        if self.memory is not None:
            return self.closer.add(self.memory.consumer())  # type: ignore[no-any-return]
        assert self.bootstrap is not None
        return self.closer.add(  # type: ignore[no-any-return]
            KafkaRequestConsumer(self.bootstrap, self.names, heartbeat_interval_ms=500)
        )


@pytest.fixture
async def request_bus(kind: str, real_infra: Any, names: Names) -> AsyncIterator[RequestBusKit]:
    partitioner = Partitioner(MODELS, REQUEST_PARTITIONS)
    if kind == REAL:
        await ensure_topics(real_infra.kafka_bootstrap, {names.request_topic: REQUEST_PARTITIONS})
        kit = RequestBusKit(kind, names, partitioner, real_infra.kafka_bootstrap)
    else:
        kit = RequestBusKit(kind, names, partitioner, None, memory=MemoryRequestBus(partitioner))
    yield kit
    await kit.closer.close_all()


# Batch bus ----------------------------------------------------------------------------------------


@dataclass
class BatchBusKit:
    kind: str
    names: Names
    model: str
    bootstrap: str | None
    closer: Closer = field(default_factory=Closer)
    memory: MemoryBatchBus | None = None

    async def producer(self) -> BatchProducer:
        producer: BatchProducer
        if self.memory is not None:
            producer = self.memory
        else:
            assert self.bootstrap is not None
            producer = KafkaBatchProducer(self.bootstrap, self.names)
        await producer.start()
        return self.closer.add(producer)  # type: ignore[no-any-return]

    def consumer(self, partition: int) -> BatchConsumer:
        """A worker's consumer. In memory it is pinned to ``partition``; over Kafka the group decides."""
        if self.memory is not None:
            return self.closer.add(self.memory.consumer(partition))  # type: ignore[no-any-return]
        assert self.bootstrap is not None
        return self.closer.add(  # type: ignore[no-any-return]
            KafkaBatchConsumer(self.bootstrap, self.names, self.model, heartbeat_interval_ms=500)
        )


@pytest.fixture
async def batch_bus(kind: str, real_infra: Any, names: Names) -> AsyncIterator[BatchBusKit]:
    model = MODELS[0]
    if kind == REAL:
        await ensure_topics(real_infra.kafka_bootstrap, {names.batch_topic(model): BATCH_PARTITIONS})
        kit = BatchBusKit(kind, names, model, real_infra.kafka_bootstrap)
    else:
        kit = BatchBusKit(kind, names, model, None, memory=MemoryBatchBus(BATCH_PARTITIONS))
    yield kit
    await kit.closer.close_all()
