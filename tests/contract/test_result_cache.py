"""The result cache's contract, in memory, over the real Redis and over a Redis Cluster: answers by key,
gone after their TTL."""

from __future__ import annotations

import asyncio
import sys
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


async def test_memory_holds_many_large_distinct_outputs_within_its_byte_bound() -> None:
    """A burst of distinct large answers (Latin, and text Python keeps at 2 and 4 bytes a character)
    pushes out the least recently used ones: what the cache holds stays under ``max_bytes``."""
    max_bytes = 1_000_000
    cache = MemoryResultCache(max_bytes=max_bytes)
    outputs = {f"k{i}": "abc✓😀"[i % 5] * 65_536 + str(i) for i in range(300)}
    for key, output in outputs.items():
        await cache.put(key, output, ttl_s=60.0)
        assert cache.held_bytes <= max_bytes, f"after {key}: {cache.held_bytes} bytes held, bound {max_bytes}"
    kept = {key: output for key, output in outputs.items() if await cache.get(key) == output}
    held = sum(sys.getsizeof(output) for output in kept.values())
    assert held <= max_bytes, f"the outputs still served hold {held} bytes; the bound is {max_bytes}"
    assert "k299" in kept and len(kept) >= 3, f"the most recent answers are kept: {sorted(kept)}"
    assert len(cache) == len(kept), f"{len(cache)} entries held, {len(kept)} served"


async def test_memory_does_not_keep_an_entry_larger_than_its_byte_bound() -> None:
    cache = MemoryResultCache(max_bytes=100_000)
    await cache.put("small", "s", ttl_s=60.0)
    await cache.put("huge", "h" * 200_000, ttl_s=60.0)
    assert await cache.get("huge") is None, "an answer over the whole bound is not cached"
    assert await cache.get("small") == "s", "and pushes nothing out"
    assert len(cache) == 1


async def test_memory_a_replaced_answer_is_counted_once() -> None:
    cache = MemoryResultCache(max_bytes=1_000_000)
    await cache.put("k", "x" * 1000, ttl_s=60.0)
    one = cache.held_bytes
    for _ in range(50):
        await cache.put("k", "x" * 1000, ttl_s=60.0)
    assert cache.held_bytes == one, f"{cache.held_bytes} bytes held for one entry, first counted {one}"


async def test_memory_drops_expired_entries_on_put() -> None:
    """After a burst the memory falls back as new answers come, without the old ones being read again."""
    clock = FakeClock()
    cache = MemoryResultCache(max_bytes=10_000_000, clock=clock)
    for i in range(1000):
        await cache.put(f"burst{i}", "o" * 1000, ttl_s=10.0)
    burst_bytes = cache.held_bytes
    clock.advance(10.0)
    await cache.put("later", "x", ttl_s=10.0)
    assert len(cache) == 1, f"{len(cache)} entries held; the burst's expired"
    assert cache.held_bytes < burst_bytes / 100, f"{cache.held_bytes} bytes held after the burst's {burst_bytes}"


async def test_memory_keeps_the_most_recently_used_entries_within_its_byte_bound() -> None:
    output = "o" * 10_000
    cache = MemoryResultCache(max_bytes=25_000)  # two such entries, not three
    await cache.put("a", output, ttl_s=60)
    await cache.put("b", output, ttl_s=60)
    assert await cache.get("a") == output  # b is now the least recently used
    await cache.put("c", output, ttl_s=60)
    held = (await cache.get("a"), await cache.get("b"), await cache.get("c"))
    assert held == (output, None, output), f"a and c kept, b out: {[value is not None for value in held]}"
    with pytest.raises(ValueError, match="max_bytes"):
        MemoryResultCache(max_bytes=0)


async def test_a_redis_cache_that_cannot_connect_raises_a_transport_error(names: Names) -> None:
    cache = RedisResultCache("redis://127.0.0.1:1/0", names)  # nothing listens on port 1
    try:
        with pytest.raises(TransportError):
            await cache.get("k")
        with pytest.raises(TransportError):
            await cache.put("k", "v", ttl_s=1.0)
    finally:
        await cache.close()
