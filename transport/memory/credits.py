"""The embedded mode's credit pool: idle workers' credits in one process, the in-memory twin of
``transport.redis.credits``."""

from __future__ import annotations

import asyncio
import time
from collections import deque

from schemas.records import Credit


def _now_ms() -> int:
    return int(time.time() * 1000)


class MemoryCreditPool:
    """Credits per model, the soonest to free claimed first (``Credit.idle_from_ms``, or the ``after_ms``
    it was offered with; FIFO among equals); a waiting claimer gets the next credit offered, in arrival
    order."""

    def __init__(self) -> None:
        self._credits: dict[str, deque[tuple[int, Credit]]] = {}
        """Each model's credits with the time they are queued at, lowest first."""
        self._waiters: dict[str, deque[asyncio.Future[Credit]]] = {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        for waiters in self._waiters.values():
            for waiter in waiters:
                waiter.cancel()

    async def offer(self, credit: Credit, *, after_ms: int = 0) -> None:
        # An expired credit (one given back late) reaches no waiting claimer: queued, a claim drops it.
        waiters = self._waiters.get(credit.model) if credit.expires_at_ms > _now_ms() else None
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(credit)
                return
        credits = self._credits.setdefault(credit.model, deque())
        queued_ms = max(credit.idle_from_ms, after_ms)
        at = len(credits)
        while at > 0 and credits[at - 1][0] > queued_ms:
            at -= 1
        credits.insert(at, (queued_ms, credit))

    async def withdraw(self, credit: Credit) -> None:
        credits = self._credits.get(credit.model, deque())
        for entry in credits:
            if entry[1] == credit:
                credits.remove(entry)
                return

    async def claim(self, model: str, timeout_s: float) -> Credit | None:
        now = _now_ms()
        credits = self._credits.get(model)
        while credits:
            _, credit = credits.popleft()
            if credit.expires_at_ms > now:
                return credit
        waiter: asyncio.Future[Credit] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(model, deque()).append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(waiter)
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return waiter.result()  # offered in the same instant the wait ran out
            waiter.cancel()
            return None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                await self.offer(waiter.result())  # hand a credit we will not use to the next claimer
            waiter.cancel()
            raise
        finally:  # a wait that ran out or was cancelled leaves no waiter for offers to walk past
            waiters = self._waiters.get(model)
            if waiters is not None and waiter in waiters:
                waiters.remove(waiter)

    async def idle(self, model: str) -> int:
        return len(self._credits.get(model, ()))

    async def offered(self, model: str) -> list[Credit]:
        return [credit for _, credit in self._credits.get(model, ())]
