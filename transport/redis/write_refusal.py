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
from transport.redis.pools import FULL_ADVICE, REDIS_ERRORS, WRITE_REFUSALS, is_out_of_memory

log = logging.getLogger(__name__)

MIB = 1024 * 1024
READ_TIMEOUT_S = 1.0
PROBE = "#!lua\nreturn 1"
"""Runs only where a write would: Redis checks a script without the ``no-writes`` flag before it runs."""

WHY = {
    "NOREPLICAS": "fewer of its replicas are connected than its min-replicas-to-write (NOREPLICAS); writes resume "
    "once a replica is back",
    "MISCONF": "it cannot write to its disk (MISCONF: a failed snapshot with stop-writes-on-bgsave-error, or a "
    "failed append-only file write); writes resume once it can (see Redis's log: a full disk?)",
}
"""Why Redis refuses writes, by the code of ``pools.WRITE_REFUSALS`` it answers with."""


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
    return _full(f"Redis uses {used / MIB:.1f} MiB, over its maxmemory of {limit / MIB:.1f} MiB, and evicts nothing")


def _full(detail: str) -> str:
    """The refusal of a full Redis, `detail` saying how full."""
    return f"the result store is full ({detail}); nothing was queued: retry after the Retry-After delay; {FULL_ADVICE}"


def refused(code: str) -> str:
    """The refusal of a Redis that answers a write with ``code`` (one of ``pools.WRITE_REFUSALS``)."""
    return f"the result store refuses writes: {WHY[code]}; nothing was queued: retry after the Retry-After delay"


Answer = tuple[str | None, str | None, str]
"""One primary's answer to the probe: its kind (``OOM``, one of ``WRITE_REFUSALS``, ``unasked``,
another error's text, or None: it takes writes), its refusal's message, and why it went unasked."""
NONE: Answer = (None, None, "")


class WriteRefusalWatch:
    """Asks every ``interval_s`` whether Redis (each primary of a Redis Cluster, all at once, each
    within ``READ_TIMEOUT_S``) would take a write, and keeps the last ``refusal``.

    A probe that gets no answer leaves no refusal: a Redis that does not answer is the connection
    checks' to report (``TaskStore.reachable``), not one that refuses writes. A probe that gets another
    error (a Redis older than 7 cannot read the script's flags) sees no refusal either, and is logged.
    """

    def __init__(self, client: Redis | RedisCluster, interval_s: float | None) -> None:
        """``interval_s``: None asks never (``refusal`` stays None)."""
        if interval_s is not None and interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self._client = client
        self.refusal: str | None = None
        self._kind: str | None = None
        """The last answer's kind: ``OOM``, one of ``WRITE_REFUSALS``, ``unasked`` (no answer), another
        error's text, or None (writes taken); the log says when it changes."""
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
        if isinstance(self._client, RedisCluster):
            targets: list[dict[str, Any]] = [{"target_nodes": node} for node in self._client.get_primaries()]
        else:
            targets = [{}]
        # Each primary within its own timeout: one that does not answer hides no other's refusal.
        async with asyncio.TaskGroup() as group:
            asked = [group.create_task(self._ask(target)) for target in targets]
        answers = [task.result() for task in asked]
        refusals = [answer for answer in answers if answer[1] is not None]
        kind, refusal, reason = (refusals or [answer for answer in answers if answer[0] is not None] or [NONE])[0]
        refusing = self.refusal is not None
        self.refusal = refusal
        REDIS_REFUSES_WRITES.set(0 if refusal is None else 1)
        REDIS_FULL.set(1 if kind == "OOM" else 0)
        was, self._kind = self._kind, kind
        if kind == was:
            return
        if kind == "OOM":
            log.warning("Redis is full, submits are refused until it has room: %s", refusal)
        elif refusal is not None:
            log.warning("Redis refuses writes, submits are refused until it takes them: %s", refusal)
        elif refusing and kind is None:
            log.warning("Redis takes writes again: submits are accepted")
        elif refusing:
            log.warning("could not ask Redis whether it still refuses writes (%s): submits are accepted", reason)
        elif kind not in (None, "unasked"):
            log.warning(
                "Redis answered the write probe with an error, read as no refusal (it needs Redis 7 and EVAL): %s",
                kind,
            )

    async def _ask(self, target: dict[str, Any]) -> Answer:
        """One primary's answer: its refusal's kind and message (a full one's memory named), and why
        it could not be asked (``unasked``)."""
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                try:
                    await self._client.execute_command("EVAL", PROBE, 0, **target)
                except ResponseError as err:
                    code = str(err).split(" ", 1)[0]
                    if code in WRITE_REFUSALS:
                        return code, refused(code), ""
                    if not is_out_of_memory(err):
                        return str(err), None, ""
                    try:
                        info = await self._client.execute_command("INFO", "memory", **target)
                    except (*REDIS_ERRORS, OSError):
                        info = {}
                    return "OOM", full_refusal(info) or _full("its used memory is over its maxmemory"), ""
        except (*REDIS_ERRORS, OSError, TimeoutError) as err:
            return "unasked", None, f"{type(err).__name__}: {err}"
        return NONE

    async def _read_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.read()
