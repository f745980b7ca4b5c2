"""The result cache in Redis: one string per answer under ``<ns>:answer:<key>``, expiring by itself.

Shared by every gateway of a deployment, in the task store's Redis. Each call is one command on a
pool of its own; a failure is a ``TransportError``, on which the gateway bypasses the cache.
"""

from __future__ import annotations

from schemas.wire import Names
from transport.redis.pools import REDIS_ERRORS, KeyedClient, PoolOptions, translate
from transport.redis.sentinel import PrimaryFollower

CACHE_POOL = PoolOptions(max_connections=32, socket_timeout_s=0.5, pool_timeout_s=0.25)
"""A look-up per request of a deterministic model; a slow Redis is bypassed after half a second
rather than holding the request for the store's longer timeouts."""


class RedisResultCache:
    """``ResultCache`` over Redis ``GET`` and ``SET ... PX``: Redis drops an entry at its TTL."""

    def __init__(
        self, redis_url: str, names: Names, *, pool: PoolOptions = CACHE_POOL, follower: PrimaryFollower | None = None
    ) -> None:
        """``follower``: behind Sentinel, the one the process's pools share (``follower_of``)."""
        self.names = names
        self._commands = KeyedClient(redis_url, pool, follower=follower)
        self._client = self._commands.redis

    async def start(self) -> None:
        await self._commands.start()

    async def close(self) -> None:
        await self._commands.close()

    async def get(self, key: str) -> str | None:
        try:
            value = await self._client.get(self.names.cached_answer(key))
        except REDIS_ERRORS as err:
            raise translate("reading the result cache", err) from err
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)

    async def put(self, key: str, output: str, ttl_s: float) -> None:
        ttl_ms = int(ttl_s * 1000)
        if ttl_ms < 1:
            return
        try:
            await self._client.set(self.names.cached_answer(key), output.encode(), px=ttl_ms)
        except REDIS_ERRORS as err:
            raise translate("writing the result cache", err) from err
