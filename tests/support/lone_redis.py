"""Fixtures for tests of Redis replication: a redis-server of the test's own, started alone (a
primary with no replica until the test starts one), and a ``RedisTaskStore`` on it.

A directory's conftest.py imports both (``tests/worker``, ``tests/batcher``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from infra.redis_server import RedisServer
from schemas.wire import Names
from transport.redis.store import RedisTaskStore


@pytest.fixture
def primary(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "primary")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def store(primary: RedisServer, names: Names) -> AsyncIterator[RedisTaskStore]:
    store = RedisTaskStore(primary.url, names)
    await store.start()
    yield store
    await store.close()
