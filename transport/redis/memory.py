"""Whether a Redis refuses writes for memory right now, read from ``INFO memory`` in the background
(of every primary of a Redis Cluster: a task goes to whichever shard its id names).

A gateway asks on every submit, with no I/O. A synchronous submit without an Idempotency-Key writes
nothing to Redis before its answer, so without this it would learn of a full Redis only at its
deadline: the worker that computed its answer cannot store it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from telemetry.metrics import REDIS_FULL
from transport.background_loop import BackgroundLoop
from transport.redis.pools import REDIS_ERRORS

log = logging.getLogger(__name__)

MIB = 1024 * 1024
READ_TIMEOUT_S = 1.0


def refusal(info: Mapping[str, Any]) -> str | None:
    """Why a Redis with this ``INFO memory`` refuses writes, else None.

    Redis refuses a write that needs memory when its used memory, less what it does not count for
    eviction (replication and AOF buffers), is over ``maxmemory`` and its policy evicts nothing
    (``noeviction``, as the stack runs it). A policy that evicts makes room instead.
    """
    limit = int(info.get("maxmemory", 0))
    if limit <= 0 or info.get("maxmemory_policy", "noeviction") != "noeviction":
        return None
    used = int(info.get("used_memory", 0)) - int(info.get("mem_not_counted_for_evict", 0))
    if used <= limit:
        return None
    return (
        f"the result store is full (Redis uses {used / MIB:.1f} MiB, over its maxmemory of {limit / MIB:.1f} MiB, "
        "and evicts nothing); nothing was queued: retry after the Retry-After delay. Room comes back as stored "
        "results expire; an operator can raise Redis's maxmemory (batchwire stack up --redis-maxmemory, "
        "BATCHWIRE_REDIS_MAXMEMORY)"
    )


class MemoryWatch:
    """Reads ``INFO memory`` every ``interval_s`` and keeps the last ``refusal``.

    A read that fails leaves no refusal: a Redis that does not answer is the connection checks'
    to report (``TaskStore.reachable``), not a full one.
    """

    def __init__(self, client: Redis | RedisCluster, interval_s: float | None) -> None:
        """``interval_s``: None reads never (``refusal`` stays None)."""
        if interval_s is not None and interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self._client = client
        self.refusal: str | None = None
        self._loop = BackgroundLoop("redis-memory-watch")

    async def start(self) -> None:
        """Reads once (so the first submit sees a full Redis), then keeps reading in the background."""
        if self.interval_s is None or self._loop.started:
            return
        await self.read()
        self._loop.start(self._read_forever(self.interval_s))

    async def close(self) -> None:
        await self._loop.close()

    async def read(self) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                if isinstance(self._client, RedisCluster):  # {node name: its INFO memory}
                    infos = list((await self._client.info("memory", target_nodes=RedisCluster.PRIMARIES)).values())
                else:
                    infos = [await self._client.info("memory")]
        except (*REDIS_ERRORS, OSError, TimeoutError):
            self.refusal = None
            REDIS_FULL.set(0)
            return
        was, self.refusal = self.refusal, next((why for info in infos if (why := refusal(info))), None)
        REDIS_FULL.set(0 if self.refusal is None else 1)
        if (was is None) != (self.refusal is None):
            if self.refusal is None:
                log.warning("Redis has room again: submits are accepted")
            else:
                log.warning("Redis is full, submits are refused until it has room: %s", self.refusal)

    async def _read_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.read()
