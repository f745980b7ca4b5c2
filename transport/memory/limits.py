"""The embedded mode's rate limiter: per-client token buckets in one process, the in-memory twin
of ``transport.redis.limits``."""

from __future__ import annotations

import time
from collections import OrderedDict


class MemoryRateLimiter:
    """``RateLimiter`` for one process: token buckets in a dict, forgetting buckets that refilled.

    Same arithmetic as the Redis script (``lua.TOKEN_BUCKET``), on the monotonic clock.
    """

    def __init__(self, rate_per_s: float, burst: int, max_clients: int = 100_000) -> None:
        if not rate_per_s > 0 or burst < 1:
            raise ValueError(f"a rate limiter needs rate_per_s > 0 and burst >= 1, got {rate_per_s} and {burst}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_clients = max_clients
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, at)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def acquire(self, client: str, tokens: int = 1) -> float:
        now = time.monotonic()
        held, at = self._buckets.pop(client, (float(self.burst), now))
        held = min(float(self.burst), held + (now - at) * self.rate_per_s)
        wait_s = 0.0
        if tokens <= 0 or held >= tokens:
            held = min(float(self.burst), held - tokens)
        else:
            wait_s = (tokens - held) / self.rate_per_s
        self._buckets[client] = (held, now)  # most recently used last
        self._forget(now)
        return wait_s

    def _forget(self, now: float) -> None:
        """Drops the least recently used buckets that are full again (forgetting them changes nothing),
        and beyond ``max_clients`` the least recently used ones whatever they hold."""
        full_after_s = self.burst / self.rate_per_s
        while self._buckets:
            client, (_, at) = next(iter(self._buckets.items()))
            if now - at < full_after_s and len(self._buckets) <= self.max_clients:
                return
            del self._buckets[client]
