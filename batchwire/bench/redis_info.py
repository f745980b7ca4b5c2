"""Redis commands per request, from the server's own counters (``INFO commandstats``), and the
memory a request leaves behind (``INFO memory``).

A count the server keeps, not one the bench infers: every command any role ran in the window is in
it, the bench's own ``INFO`` calls excepted. It tells what a request costs the result store, which
CPU seconds of a Redis shared by other work would not. The memory is ``used_memory``'s growth over
the window per answered request: each task stays for the result TTL, so while the window is shorter
than the TTL the growth is what a task holds (its record, result and keys, with the allocator's
share); ``batchwire plan --costs`` sizes the shards' memory from it.
"""

from __future__ import annotations

from typing import Any, TypedDict

from redis.asyncio import ConnectionPool, Redis, RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from transport.redis.pools import cluster_nodes, is_cluster_url
from transport.redis.sentinel import is_sentinel_url, sentinel_pool

TOP = 8
"""Commands listed by name in a report; the rest are in the total."""
TIMEOUT_S = 2.0


class RedisCommands(TypedDict):
    total: int
    per_request: float | None
    by_command: dict[str, float]
    """The ``TOP`` most frequent commands, each per answered request."""


async def counts(url: str) -> tuple[dict[str, int], int] | None:
    """Calls so far by command name (lower case), and ``used_memory`` in bytes, in one ``INFO``; None
    when Redis cannot be read. Behind Sentinel, the primary's; of a Redis Cluster, its primaries' summed
    (a replica's commands are its primary's writes again)."""
    try:
        infos = await _infos(url)
    except (RedisError, RedisClusterException, OSError, ValueError):  # ValueError: a URL redis-py cannot take
        return None
    calls: dict[str, int] = {}
    memory = 0
    for info in infos:
        for name, entry in info.items():
            if name.startswith("cmdstat_"):
                command = name.removeprefix("cmdstat_")
                calls[command] = calls.get(command, 0) + int(entry["calls"])
        memory += int(info["used_memory"])
    return calls, memory


async def _infos(url: str) -> list[dict[str, Any]]:
    """``INFO all`` of the server ``url`` names, or of each primary of its cluster."""
    if is_cluster_url(url):
        nodes, user, password = cluster_nodes(url)
        cluster = RedisCluster(startup_nodes=nodes, username=user, password=password, socket_timeout=TIMEOUT_S)
        try:
            replies: dict[str, dict[str, Any]] = await cluster.info("all", target_nodes=RedisCluster.PRIMARIES)
        finally:
            await cluster.aclose()
        return list(replies.values())
    if is_sentinel_url(url):
        pool: ConnectionPool = sentinel_pool(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
    else:
        pool = ConnectionPool.from_url(url, socket_timeout=TIMEOUT_S)
    try:
        return [await Redis(connection_pool=pool).info("all")]
    finally:
        await pool.disconnect()


def bytes_per_request(start: int, end: int, answers: int) -> float | None:
    """``used_memory``'s growth per answered request (None: none answered, or the memory shrank, as it
    does when tasks older than the window expire in it)."""
    return round((end - start) / answers, 1) if answers and end > start else None


def per_request(start: dict[str, int], end: dict[str, int], answers: int) -> RedisCommands:
    """The commands run between two counts, in all and per answered request."""
    ran = {name: calls - start.get(name, 0) for name, calls in end.items() if name != "info"}
    ran = {name: calls for name, calls in ran.items() if calls > 0}
    total = sum(ran.values())
    top = sorted(ran.items(), key=lambda item: -item[1])[:TOP]
    return RedisCommands(
        total=total,
        per_request=round(total / answers, 2) if answers else None,
        by_command={name: round(calls / answers, 2) if answers else float(calls) for name, calls in top},
    )
