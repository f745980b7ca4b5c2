"""redis-py's ``BlockingConnectionPool``, whose waiters hand a wakeup on when they leave.

A released connection wakes one waiter (``asyncio.Condition.notify``). On Python 3.11 a waiter that is
cancelled in the turn it was woken (its caller's timeout, a readiness probe's, its own pool timeout)
leaves with the wakeup: the connection lies free while the next waiter waits out its pool timeout and
fails. Every pool that makes callers wait (the command
pools, over one Redis or behind Sentinel) is one of these.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import BlockingConnectionPool


class BlockingPool(BlockingConnectionPool):
    """A waiter that leaves without a connection wakes the next one, which looks again for a free one."""

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        except BaseException:
            # Shielded: a caller cancelled again must not take this wakeup with it as well.
            await asyncio.shield(self._wake_next())
            raise

    async def _wake_next(self) -> None:
        async with self._condition:
            self._condition.notify()
