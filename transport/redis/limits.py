"""Per-client rate limits in Redis: one token bucket per client, shared by every gateway.

Each acquire is one script call (``lua.TOKEN_BUCKET``) that refills the bucket by the time
passed on the Redis server's clock, takes a token if there is one, and sets the bucket to expire
once it would be full again, all atomically: two gateways taking from one bucket at the same
instant cannot both take its last token.
"""

from __future__ import annotations

import hashlib
import uuid

from schemas.wire import Names
from transport.redis.lua import TOKEN_BUCKET
from transport.redis.pools import REDIS_ERRORS, KeyedClient, PoolOptions, translate
from transport.redis.sentinel import PrimaryFollower


def bucket_id(client: str) -> str:
    """A fixed-size, key-safe name for a client identity (an IP, a header value, an owner hash)."""
    return hashlib.sha256(client.encode()).hexdigest()[:32]


LIMITS_POOL = PoolOptions(max_connections=16)  # one token per gateway request


class RedisRateLimiter:
    """``RateLimiter`` over Redis: ``rate_per_s`` tokens per second, at most ``burst`` saved up."""

    def __init__(
        self,
        redis_url: str,
        names: Names,
        rate_per_s: float,
        burst: int,
        *,
        pool: PoolOptions = LIMITS_POOL,
        follower: PrimaryFollower | None = None,
    ) -> None:
        """``follower``: behind Sentinel, the one the process's pools share (``follower_of``)."""
        if not rate_per_s > 0 or burst < 1:
            raise ValueError(f"a rate limiter needs rate_per_s > 0 and burst >= 1, got {rate_per_s} and {burst}")
        self.names = names
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._commands = KeyedClient(redis_url, pool, follower=follower)
        self._client = self._commands.redis
        self._script = self._client.register_script(TOKEN_BUCKET)

    async def start(self) -> None:
        await self._commands.start()

    async def close(self) -> None:
        await self._commands.close()

    async def acquire(self, client: str, tokens: int = 1) -> float:
        key = self.names.rate_bucket(bucket_id(client))
        try:
            # The call's id: redis-py retries once on a dropped connection, and the script may have run.
            op = uuid.uuid4().hex
            wait_us = await self._script(keys=[key], args=[repr(float(self.rate_per_s)), self.burst, tokens, op])
        except REDIS_ERRORS as err:
            raise translate("taking a rate-limit token", err) from err
        return int(wait_us) / 1_000_000
