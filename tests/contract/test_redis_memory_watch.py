"""When a Redis refuses writes for memory, as ``INFO memory`` shows it (``transport.redis.memory``)."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from transport.redis.memory import MemoryWatch, refusal
from transport.redis.pools import KeyedClient, PoolOptions, cluster_nodes

MIB = 1024 * 1024


def info(used: int, limit: int, policy: str = "noeviction", not_counted: int = 0) -> dict[str, object]:
    return {
        "used_memory": used,
        "maxmemory": limit,
        "maxmemory_policy": policy,
        "mem_not_counted_for_evict": not_counted,
    }


def test_over_maxmemory_without_eviction_is_a_refusal_that_says_what_to_change() -> None:
    message = refusal(info(70 * MIB, 64 * MIB))
    assert message is not None
    assert "result store is full" in message and "70.0 MiB" in message and "64.0 MiB" in message
    assert "--redis-maxmemory" in message and "Retry-After" in message


@pytest.mark.parametrize(
    "memory",
    [
        info(64 * MIB, 64 * MIB),  # at the bound: Redis refuses only over it
        info(70 * MIB, 0),  # no bound
        info(70 * MIB, 64 * MIB, policy="allkeys-lru"),  # it evicts to make room
        info(70 * MIB, 64 * MIB, not_counted=8 * MIB),  # replication and AOF buffers do not count
    ],
)
def test_room_or_eviction_is_no_refusal(memory: dict[str, object]) -> None:
    assert refusal(memory) is None


@pytest.mark.kafka
async def test_over_a_cluster_one_full_primary_is_a_refusal(redis_cluster: str) -> None:
    """A task goes to the shard its id names, so a full primary refuses some submits: the watch reads
    every primary's ``INFO memory``."""
    watch_client = KeyedClient(redis_cluster, PoolOptions())
    await watch_client.start()
    watch = MemoryWatch(watch_client.redis, interval_s=60.0)
    node = cluster_nodes(redis_cluster)[0][0]
    primary = Redis(host=node.host, port=node.port)
    try:
        await watch.read()
        assert watch.refusal is None, "no primary is full"
        assert (await primary.info("replication"))["role"] == "master", "the first node is a primary"
        await primary.config_set("maxmemory", "1")
        await watch.read()
        assert watch.refusal is not None and "result store is full" in watch.refusal
    finally:
        await primary.config_set("maxmemory", "0")
        await primary.aclose()
        await watch.close()
        await watch_client.close()
