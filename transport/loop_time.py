"""A timeout that counts only the time the event loop could run.

``asyncio.timeout`` counts a stall of the loop (a callback that blocked it, a process starved of CPU)
against what is awaited: an answer that came during the stall waits unread in its socket, and the
timeout expires in the very turn that reads it. A probe bounded so reports its dependency down for
the process's own stall. ``timeout`` ticks every ``TICK_S`` and counts a late tick as one tick, so a
stall costs the wait at most ``TICK_S``, and the answer that came meanwhile is read.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

TICK_S = 0.05


@asynccontextmanager
async def timeout(timeout_s: float) -> AsyncIterator[None]:
    """As ``asyncio.timeout(timeout_s)`` (``TimeoutError`` when it expires), counting only the time in
    which the loop could run. A tick every ``TICK_S``: for rare waits (probes), not per request."""
    async with asyncio.timeout(None) as bound:
        ticks = _Ticks(bound, timeout_s)
        try:
            yield
        finally:
            ticks.cancel()


class _Ticks:
    """Expires ``bound`` once ``left_s`` of ticks have passed, a late tick counting as one."""

    def __init__(self, bound: asyncio.Timeout, left_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._bound = bound
        self._left_s = left_s
        self._ticked_at = self._loop.time()
        self._handle = self._loop.call_later(min(TICK_S, max(0.0, left_s)), self._tick)

    def cancel(self) -> None:
        self._handle.cancel()

    def _tick(self) -> None:
        now = self._loop.time()
        self._left_s -= min(now - self._ticked_at, TICK_S)
        self._ticked_at = now
        if self._left_s <= 0:
            self._bound.reschedule(now)  # expires at once
        else:
            self._handle = self._loop.call_later(min(TICK_S, self._left_s), self._tick)
