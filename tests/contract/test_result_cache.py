"""The result cache's contract, in memory, over the real Redis and over a Redis Cluster: answers by key,
gone after their TTL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from schemas.wire import Names
from tests.support.fake_clock import FakeClock
from transport.memory.cache import MemoryResultCache
from transport.ports import ResultCache, TransportError
from transport.redis.cache import RedisResultCache

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def cache(keyed_url: str | None, names: Names) -> AsyncIterator[ResultCache]:
    made: ResultCache = RedisResultCache(keyed_url, names) if keyed_url is not None else MemoryResultCache()
    await made.start()
    yield made
    await made.close()


async def test_an_answer_is_read_back_under_its_key_only(cache: ResultCache) -> None:
    await cache.put("k1", "olleh ✓", ttl_s=60.0)
    assert await cache.get("k1") == "olleh ✓"
    assert await cache.get("k2") is None


async def test_a_later_answer_replaces_the_earlier(cache: ResultCache) -> None:
    await cache.put("k", "first", ttl_s=60.0)
    await cache.put("k", "second", ttl_s=60.0)
    assert await cache.get("k") == "second"


async def test_an_answer_is_gone_after_its_ttl(cache: ResultCache) -> None:
    await cache.put("short", "x", ttl_s=0.2)
    await cache.put("long", "y", ttl_s=60.0)
    deadline = time.monotonic() + 10
    while await cache.get("short") is not None:  # polled as ``eventually`` polls, with an async read
        assert time.monotonic() < deadline, "the short entry outlived its TTL by 10 s"
        await asyncio.sleep(0.01)
    assert await cache.get("long") == "y", "the other entry lives on"


async def test_memory_entries_expire_on_the_injected_clock() -> None:
    clock = FakeClock()
    cache = MemoryResultCache(clock=clock)
    await cache.put("k", "out", ttl_s=10.0)
    clock.advance(9.999)
    assert await cache.get("k") == "out"
    clock.advance(0.001)
    assert await cache.get("k") is None, "at its TTL an entry reads as a miss"
    assert len(cache) == 0, "and is dropped"


async def test_memory_keeps_the_most_recently_used_entries() -> None:
    cache = MemoryResultCache(max_entries=2)
    await cache.put("a", "1", ttl_s=60)
    await cache.put("b", "2", ttl_s=60)
    assert await cache.get("a") == "1"  # b is now the least recently used
    await cache.put("c", "3", ttl_s=60)
    assert (await cache.get("a"), await cache.get("b"), await cache.get("c")) == ("1", None, "3")
    with pytest.raises(ValueError, match="max_entries"):
        MemoryResultCache(max_entries=0)


async def test_a_redis_cache_that_cannot_connect_raises_a_transport_error(names: Names) -> None:
    cache = RedisResultCache("redis://127.0.0.1:1/0", names)  # nothing listens on port 1
    try:
        with pytest.raises(TransportError):
            await cache.get("k")
        with pytest.raises(TransportError):
            await cache.put("k", "v", ttl_s=1.0)
    finally:
        await cache.close()
