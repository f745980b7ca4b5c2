"""Whether a Redis refuses writes right now, asked in the background (of every primary of a Redis
Cluster: a task goes to whichever shard its id names).

A gateway asks on every submit, with no I/O. A synchronous submit without an Idempotency-Key writes
nothing to Redis before its answer, so without this it would learn of a Redis that refuses writes only
at its deadline: the worker that computed its answer cannot store it.

Redis itself says whether it would take a write: ``PROBE`` is a script that writes nothing but does not
declare ``no-writes`` (Redis 7's script flags), so Redis refuses to run it as it refuses any write
(``OOM``: used memory over ``maxmemory`` with ``noeviction``; ``NOREPLICAS``: fewer replicas than its
``min-replicas-to-write``; ``MISCONF``: it cannot save to disk). A full Redis's refusal then names its
memory, read from ``INFO memory``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from telemetry.metrics import REDIS_FULL, REDIS_REFUSES_WRITES
from transport.background_loop import BackgroundLoop
from transport.redis.pools import REDIS_ERRORS, is_out_of_memory

log = logging.getLogger(__name__)

MIB = 1024 * 1024
READ_TIMEOUT_S = 1.0
PROBE = "#!lua\nreturn 1"
"""Runs only where a write would: Redis checks a script without the ``no-writes`` flag before it runs."""

FULL = (
    "the result store is full{detail}; nothing was queued: retry after the Retry-After delay. Room comes back "
    "as stored results expire; an operator can raise Redis's maxmemory (batchwire stack up --redis-maxmemory, "
    "BATCHWIRE_REDIS_MAXMEMORY)"
)
REFUSED = {
    "NOREPLICAS": "fewer of its replicas are connected than its min-replicas-to-write (NOREPLICAS); writes resume "
    "once a replica is back",
    "MISCONF": "it cannot save to disk (MISCONF: stop-writes-on-bgsave-error after a failed snapshot); writes "
    "resume once a snapshot succeeds (see Redis's log)",
}


def full_refusal(info: Mapping[str, Any]) -> str | None:
    """Why a Redis with this ``INFO memory`` refuses writes for memory, else None.

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
    return FULL.format(
        detail=f" (Redis uses {used / MIB:.1f} MiB, over its maxmemory of {limit / MIB:.1f} MiB, and evicts nothing)"
    )


def refused(err: ResponseError) -> str | None:
    """The refusal a probe's error reply is (None: not a refusal of writes, such as a script error)."""
    if is_out_of_memory(err):
        return FULL.format(detail=" (Redis used memory is over its maxmemory, and it evicts nothing)")
    code = str(err).split(" ", 1)[0]
    if code not in REFUSED:
        return None
    return f"the result store refuses writes: {REFUSED[code]}; nothing was queued: retry after the Retry-After delay"


class WriteRefusalWatch:
    """Asks every ``interval_s`` whether Redis would take a write, and keeps the last ``refusal``.

    A probe that fails to get an answer leaves no refusal: a Redis that does not answer is the
    connection checks' to report (``TaskStore.reachable``), not one that refuses writes.
    """

    def __init__(self, client: Redis | RedisCluster, interval_s: float | None) -> None:
        """``interval_s``: None asks never (``refusal`` stays None)."""
        if interval_s is not None and interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self._client = client
        self.refusal: str | None = None
        self._loop = BackgroundLoop("redis-write-refusal-watch")

    async def start(self) -> None:
        """Asks once (so the first submit sees a refusal), then keeps asking in the background."""
        if self.interval_s is None or self._loop.started:
            return
        await self.read()
        self._loop.start(self._read_forever(self.interval_s))

    async def close(self) -> None:
        await self._loop.close()

    async def read(self) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                refusal, full = await self._ask()
        except (*REDIS_ERRORS, OSError, TimeoutError):
            refusal, full = None, False
        was, self.refusal = self.refusal, refusal
        REDIS_REFUSES_WRITES.set(0 if refusal is None else 1)
        REDIS_FULL.set(1 if full else 0)
        if (was is None) != (refusal is None):
            if refusal is None:
                log.warning("Redis takes writes again: submits are accepted")
            elif full:
                log.warning("Redis is full, submits are refused until it has room: %s", refusal)
            else:
                log.warning("Redis refuses writes, submits are refused until it takes them: %s", refusal)

    async def _ask(self) -> tuple[str | None, bool]:
        """The first primary's refusal (with a full one's memory named), and whether it is for memory."""
        if isinstance(self._client, RedisCluster):
            targets: list[dict[str, Any]] = [{"target_nodes": node} for node in self._client.get_primaries()]
        else:
            targets = [{}]
        for target in targets:
            try:
                await self._client.execute_command("EVAL", PROBE, 0, **target)
            except ResponseError as err:
                if (refusal := refused(err)) is None:
                    continue
                if not is_out_of_memory(err):
                    return refusal, False
                info = await self._client.execute_command("INFO", "memory", **target)
                return full_refusal(info) or refusal, True
        return None, False

    async def _read_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.read()
