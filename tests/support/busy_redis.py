"""A Redis server kept busy for a while (a script that spins), so that it answers late: the commands
sent meanwhile run once the script ends. Every client's commands wait, so a test runs it on a Redis of
its own (``tests.support.lone_redis.primary``), never on the session's, which other tests share."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis

from tests.support.eventually import eventually
from transport.redis.pools import sync_client

SPIN = """
local from = redis.call('TIME')
repeat
  local now = redis.call('TIME')
until (now[1] - from[1]) * 1000000 + (now[2] - from[2]) >= tonumber(ARGV[1])
"""


def _answers(client: redis.Redis | redis.RedisCluster) -> bool:
    try:
        return bool(client.ping())
    except redis.TimeoutError:
        return False


@asynccontextmanager
async def busy_redis(redis_url: str, busy_s: float) -> AsyncIterator[None]:
    """Enters once the server at ``redis_url`` runs a script of ``busy_s``; leaves once it has ended."""
    spinner = sync_client(redis_url, 10 * busy_s)
    probe = sync_client(redis_url, 0.05)
    spin = threading.Thread(target=spinner.eval, args=(SPIN, 0, round(busy_s * 1e6)), daemon=True)
    try:
        spin.start()
        await eventually(lambda: not _answers(probe), "Redis to run the script")
        yield
    finally:
        await asyncio.to_thread(spin.join)
        spinner.close()
        probe.close()
