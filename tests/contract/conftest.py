"""Contract-test fixtures: each transport built either in memory or over the real Kafka and Redis.

Every test that takes ``kind`` runs twice, so the in-memory transports (embedded mode, unit tests)
are held to the same contract as the Kafka and Redis ones. Real infrastructure comes from the
session fixture ``infra`` (tests/conftest.py); ``names`` gives every test its own topics and keys.
The Redis transports' contracts (the task store's among them) run twice more: over a Redis Cluster
of three primaries (``redis_cluster``) and behind a Sentinel (``redis_sentinel``). ``primary`` is a
redis-server of the test's own, for a test that holds every command to it (``tests.support.busy_redis``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from schemas.wire import Names
from tests.support.lone_redis import primary  # noqa: F401 (pytest finds fixtures by name)
from tests.support.transport_kits import (
    BATCH_PARTITIONS,
    MODELS,
    REAL,
    REQUEST_PARTITIONS,
    BatchBusKit,
    Closer,
    PoolFactory,
    RequestBusKit,
    StoreFactory,
    ensure_topics,
)
from transport.memory.batches import MemoryBatchBus
from transport.memory.credits import MemoryCreditPool
from transport.memory.requests import MemoryRequestBus
from transport.memory.store import MemoryTaskStore
from transport.ports import CreditPool, TaskStore
from transport.redis.credits import RedisCreditPool
from transport.redis.store import RedisTaskStore
from transport.routing import Partitioner


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


# Task store ---------------------------------------------------------------------------------------


@pytest.fixture
async def make_store(keyed_url: str | None, names: Names) -> AsyncIterator[StoreFactory]:
    """Each call is one process's view of the store: a new Redis client, or the one shared memory store."""
    closer = Closer()
    shared: list[MemoryTaskStore] = []

    async def make(ttl_s: float = 3600.0) -> TaskStore:
        if keyed_url is None and shared:
            return shared[0]
        store: TaskStore
        if keyed_url is not None:
            # A first PING over a Sentinel asks it for the primary and connects: on a busy machine that
            # takes longer than the default ready timeout, which bounds the answer of a live store.
            store = RedisTaskStore(keyed_url, names, ttl_s=ttl_s, ready_timeout_s=5.0)
        else:
            shared.append(MemoryTaskStore(ttl_s=ttl_s))
            store = shared[0]
        await store.start()
        return closer.add(store)  # type: ignore[no-any-return]

    yield make
    await closer.close_all()


# Credit pool --------------------------------------------------------------------------------------


@pytest.fixture
async def make_pool(keyed_url: str | None, names: Names) -> AsyncIterator[PoolFactory]:
    """Each call is one process's view of the pool: a new Redis client, or the one shared memory pool."""
    closer = Closer()
    shared = MemoryCreditPool()

    async def make() -> CreditPool:
        pool: CreditPool = RedisCreditPool(keyed_url, names) if keyed_url is not None else shared
        await pool.start()
        if keyed_url is not None or not closer.items:
            closer.add(pool)
        return pool

    yield make
    await closer.close_all()


# Request bus --------------------------------------------------------------------------------------


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
