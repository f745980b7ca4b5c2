"""Who a caller is, and whether the deployment takes one more request from them right now.

Checked before anything is stored or produced, cheapest first: the deployment's queue depth (a
cached figure, no I/O), then the client's rate limit (one store round trip, only when limits are
on). A refusal says what limit was hit and which setting raises it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchwire.transport.base import QueueDepth, RateLimiter, TransportError
from gateway.errors import Overloaded, RateLimited, Unavailable
from gateway.settings import GatewaySettings, env_name


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request.

    ``owner`` (the API key's owner id, None without API keys) sees only the tasks it created;
    ``client`` (``key:<owner>``, ``id:<X-Client-Id>`` or ``ip:<address>``) is whose rate limit a
    submit counts against.
    """

    owner: str | None = None
    client: str = "-"


ANONYMOUS = Caller()


class Admission:
    """The deployment-wide checks of one submit: queue depth, then the client's rate limit."""

    def __init__(self, settings: GatewaySettings, queue_depth: QueueDepth | None, limiter: RateLimiter | None) -> None:
        self.max_queue_depth = settings.max_queue_depth
        self.retry_after_s = settings.retry_after_s
        self._queue_depth = queue_depth if settings.max_queue_depth > 0 else None
        self._limiter = limiter if settings.rate_limit_per_s > 0 else None
        self.active = self._queue_depth is not None or self._limiter is not None
        """Whether a submit has anything to check here (else the gateway skips the call)."""

    async def admit(self, caller: Caller) -> None:
        """Returns when the request may go on; raises ``Overloaded``, ``RateLimited`` or ``Unavailable``."""
        if self._queue_depth is not None:
            depth = await self._queue_depth.depth()
            if depth >= self.max_queue_depth:
                raise Overloaded(
                    f"the deployment holds {depth} requests not yet handed to a worker, its limit "
                    f"({env_name('max_queue_depth')} = {self.max_queue_depth}); nothing was queued: retry after "
                    "the Retry-After delay"
                )
        limiter = self._limiter
        if limiter is not None:
            try:
                wait_s = await limiter.acquire(caller.client)
            except TransportError as err:
                raise Unavailable(f"the rate limiter's store is unavailable: {err}") from err
            if wait_s > 0:
                raise RateLimited(
                    f"this client is over its rate limit of {limiter.rate_per_s:g} requests/s with bursts of "
                    f"{limiter.burst} ({env_name('rate_limit_per_s')}, {env_name('rate_limit_burst')}); "
                    f"the next request is accepted in {wait_s:.3f} s",
                    retry_after_s=max(1, math.ceil(wait_s)),
                )
