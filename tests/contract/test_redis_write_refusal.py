"""When a Redis refuses writes, as Redis itself answers a script that may write (``transport.redis.write_refusal``),
and how much memory a full one uses, as ``INFO memory`` shows it."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import OutOfMemoryError

from infra.redis_cluster import LocalRedisCluster
from infra.redis_server import RedisServer
from telemetry.metrics import REGISTRY
from tests.support.eventually import eventually
from transport.redis.pools import FULL_ADVICE, KeyedClient, PoolOptions, translate
from transport.redis.write_refusal import READ_TIMEOUT_S, WriteRefusalWatch, full_refusal

MIB = 1024 * 1024


def info(used: int, limit: int, policy: str = "noeviction", not_counted: int = 0) -> dict[str, object]:
    return {
        "used_memory": used,
        "maxmemory": limit,
        "maxmemory_policy": policy,
        "mem_not_counted_for_evict": not_counted,
    }


def test_over_maxmemory_without_eviction_is_a_refusal_that_says_what_to_change() -> None:
    message = full_refusal(info(70 * MIB, 64 * MIB))
    assert message is not None
    assert "result store is full" in message and "70.0 MiB" in message and "64.0 MiB" in message
    assert "--redis-maxmemory" in message and "Retry-After" in message


def test_a_refused_submit_and_a_failed_write_give_one_advice_on_a_full_redis() -> None:
    refusal = full_refusal(info(70 * MIB, 64 * MIB))
    failed_write = str(
        translate("storing results", OutOfMemoryError("command not allowed when used memory > 'maxmemory'."))
    )
    assert refusal is not None and FULL_ADVICE in refusal, f"expected {FULL_ADVICE!r} in the refusal: {refusal}"
    assert FULL_ADVICE in failed_write, f"expected {FULL_ADVICE!r} in the failed write's message: {failed_write}"


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
    assert full_refusal(memory) is None


@pytest.mark.kafka
async def test_over_a_cluster_one_full_primary_is_a_refusal(redis_cluster: str) -> None:
    """A task goes to the shard its id names, so a full primary refuses some submits: the watch asks
    every primary, not only the one its client sends keyless commands to."""
    watch_client = KeyedClient(redis_cluster, PoolOptions())
    await watch_client.start()
    cluster = watch_client.redis
    assert isinstance(cluster, RedisCluster)
    watch = WriteRefusalWatch(cluster, interval_s=60.0)
    default = cluster.get_default_node()
    node = next(node for node in cluster.get_primaries() if node.name != default.name)
    primary = Redis(host=node.host, port=int(node.port))
    try:
        await watch.read()
        assert watch.refusal is None, "no primary is full"
        assert (await primary.info("replication"))["role"] == "master", "it is a primary"
        await primary.config_set("maxmemory", "1")
        await watch.read()
        assert watch.refusal is not None and "result store is full" in watch.refusal
    finally:
        await primary.config_set("maxmemory", "0")
        await primary.aclose()
        await watch.close()
        await watch_client.close()


@pytest.mark.kafka
async def test_over_a_cluster_a_primary_that_does_not_answer_hides_no_other_primarys_refusal(tmp_path: Path) -> None:
    """One primary frozen (SIGSTOP), another full: the watch asks each within its own timeout, so the
    full one's refusal is seen in the same read, not only once the frozen one answers again."""
    with LocalRedisCluster(tmp_path / "cluster") as local:
        watch_client = KeyedClient(local.url, PoolOptions())
        await watch_client.start()
        cluster = watch_client.redis
        assert isinstance(cluster, RedisCluster)
        watch = WriteRefusalWatch(cluster, interval_s=60.0)
        frozen, full, *_ = cluster.get_primaries()  # the order the watch asks them in
        frozen_pid = next(node.pid for node in local.nodes if node.port == int(frozen.port))
        assert frozen_pid is not None
        primary = Redis(host=full.host, port=int(full.port))
        try:
            await primary.config_set("maxmemory", "1")
            os.kill(frozen_pid, signal.SIGSTOP)
            started = time.monotonic()
            await watch.read()
            took_s = time.monotonic() - started
            assert watch.refusal is not None and "result store is full" in watch.refusal, (
                f"the full primary's refusal, behind a frozen one: {watch.refusal!r}"
            )
            assert took_s < 3 * READ_TIMEOUT_S, f"one read took {took_s:.1f} s"
        finally:
            os.kill(frozen_pid, signal.SIGCONT)
            await primary.config_set("maxmemory", "0")
            await primary.aclose()
            await watch.close()
            await watch_client.close()


class _Primaries(RedisCluster):
    """Two primaries with no server: the first's probe fails unexpectedly, the second's never ends."""

    def __init__(self) -> None:  # connects nowhere
        self.hung = asyncio.Event()

    def get_primaries(self) -> list[Any]:
        return ["failing", "hung"]

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("target_nodes") == "failing":
            await self.hung.wait()  # the other's probe is under way
            raise RuntimeError("a fault no probe expects")
        self.hung.set()
        await asyncio.Event().wait()


async def test_a_probe_that_fails_unexpectedly_leaves_no_other_probe_running() -> None:
    """Each primary is asked in a task of the read's own: one failing ends the read with the others
    cancelled and awaited, none left running unowned."""
    watch = WriteRefusalWatch(_Primaries(), interval_s=60.0)
    with pytest.raises(ExceptionGroup) as raised:
        await watch.read()
    assert raised.group_contains(RuntimeError, match="a fault no probe expects")
    left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    assert not left, f"probes left running: {left}"


@dataclass(frozen=True)
class OwnRedis:
    """A redis-server of the test's own (its settings change), a client of it, and a watch over that client."""

    server: RedisServer
    client: Redis
    watch: WriteRefusalWatch


@pytest.fixture
async def own(tmp_path: Path) -> AsyncIterator[OwnRedis]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    client = Redis.from_url(server.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        yield OwnRedis(server, client, WriteRefusalWatch(client, interval_s=60.0))
    finally:
        await client.aclose()
        server.work_dir.mkdir(parents=True, exist_ok=True)  # a test may have removed it
        server.stop()


@pytest.mark.kafka
async def test_a_full_redis_that_stops_answering_leaves_the_full_gauge_at_0(own: OwnRedis) -> None:
    """A read that fails leaves no refusal (the outage is the connection checks' to report): the gauge
    batchwire_redis_full follows, rather than saying "full" for as long as the outage lasts."""
    await own.client.config_set("maxmemory", "1")
    await own.watch.read()
    assert own.watch.refusal is not None and REGISTRY.get_sample_value("batchwire_redis_full") == 1
    own.server.stop()
    await own.watch.read()
    assert own.watch.refusal is None
    assert REGISTRY.get_sample_value("batchwire_redis_full") == 0, "the gauge still says full"


@pytest.mark.kafka
async def test_a_redis_short_of_replicas_is_a_refusal_that_names_it_until_a_write_would_pass(own: OwnRedis) -> None:
    """``min-replicas-to-write`` over the replicas connected: Redis refuses every write (``NOREPLICAS``),
    and says so to the probe, which writes nothing."""
    client, watch = own.client, own.watch
    await watch.read()
    assert watch.refusal is None and REGISTRY.get_sample_value("batchwire_redis_refuses_writes") == 0
    await client.config_set("min-replicas-to-write", 1)
    await watch.read()
    assert watch.refusal is not None and "NOREPLICAS" in watch.refusal, watch.refusal
    assert "min-replicas-to-write" in watch.refusal and "Retry-After" in watch.refusal, watch.refusal
    assert REGISTRY.get_sample_value("batchwire_redis_refuses_writes") == 1
    assert REGISTRY.get_sample_value("batchwire_redis_full") == 0, "short of replicas is not full"
    assert await client.dbsize() == 0, "the probe wrote nothing"
    await client.config_set("min-replicas-to-write", 0)
    await watch.read()
    assert watch.refusal is None and REGISTRY.get_sample_value("batchwire_redis_refuses_writes") == 0


@pytest.mark.kafka
async def test_a_redis_that_cannot_save_to_disk_is_a_refusal_that_names_it(own: OwnRedis) -> None:
    """A failed snapshot with ``stop-writes-on-bgsave-error`` (Redis's default) and snapshots on: every
    write is refused (``MISCONF``). The snapshot fails here because the server's folder is gone."""
    client, watch = own.client, own.watch
    await client.config_set("save", "3600 1")
    shutil.rmtree(own.server.work_dir)
    await client.bgsave()
    with redis.Redis.from_url(own.server.url, socket_timeout=1.0) as blocking:

        def failed() -> bool:
            return bool(blocking.info("persistence")["rdb_last_bgsave_status"] == "err")

        await eventually(failed, "the snapshot to fail")
    await watch.read()
    assert watch.refusal is not None and "MISCONF" in watch.refusal, watch.refusal
    assert "disk" in watch.refusal and "Retry-After" in watch.refusal, watch.refusal
    await client.config_set("save", "")  # no snapshots: a failed one no longer stops writes
    await watch.read()
    assert watch.refusal is None


@pytest.mark.kafka
async def test_a_full_redis_whose_memory_cannot_be_read_is_still_a_refusal(own: OwnRedis) -> None:
    """The probe's ``OOM`` decides; ``INFO memory`` only names the figures, and a client that may not read
    it (an ACL without ``info``) still sees the refusal."""
    limited = Redis(host="127.0.0.1", port=own.server.port, username="probe", password="pw", socket_timeout=1.0)
    watch = WriteRefusalWatch(limited, interval_s=60.0)
    try:
        await own.client.acl_setuser("probe", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-info"])
        await own.client.config_set("maxmemory", "1")
        await watch.read()
        assert watch.refusal is not None and "result store is full" in watch.refusal, watch.refusal
        assert REGISTRY.get_sample_value("batchwire_redis_full") == 1
    finally:
        await limited.aclose()
