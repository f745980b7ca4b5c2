"""When a Redis refuses writes for memory, as ``INFO memory`` shows it (``transport.redis.memory``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.asyncio import Redis

from infra.redis_server import RedisServer
from telemetry.metrics import REGISTRY
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


@pytest.mark.kafka
async def test_a_full_redis_that_stops_answering_leaves_the_full_gauge_at_0(tmp_path: Path) -> None:
    """A read that fails leaves no refusal (the outage is the connection checks' to report): the gauge
    batchwire_redis_full follows, rather than saying "full" for as long as the outage lasts."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    client = Redis.from_url(server.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    watch = MemoryWatch(client, interval_s=60.0)
    try:
        await client.config_set("maxmemory", "1")
        await watch.read()
        assert watch.refusal is not None and REGISTRY.get_sample_value("batchwire_redis_full") == 1
        server.stop()
        await watch.read()
        assert watch.refusal is None
        assert REGISTRY.get_sample_value("batchwire_redis_full") == 0, "the gauge still says full"
    finally:
        await client.aclose()
        server.stop()
