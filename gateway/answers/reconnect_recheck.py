"""After the task store's change feed was down, every held synchronous caller is looked up at once.

Replies travel over Redis PubSub, which keeps nothing for a subscriber that is away: a reply
published while the feed reconnects (a Redis restart, a Sentinel failover to a new primary) is
lost. The store calls back once its feed has subscribed the reply channel again
(``TaskStore.on_feed_return``), so a read of the store from then on misses nothing:
:class:`ReconnectRecheck` reads the task of every caller still waiting and hands the ended ones
their answer, rather than leaving them to the lost-reply sweep (``reply_recheck_s``, with its
backoff). Long-polls and event streams watch task channels, which the store re-reads itself as it
subscribes them again.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.answers.waiters import ReplyWaiters
from gateway.errors import TRANSPORT_ERRORS
from transport.background_loop import BackgroundLoop
from transport.ports import TaskStore

log = logging.getLogger(__name__)

_CHUNK = 500  # task ids per store read: one pipeline of HMGETs each


class ReconnectRecheck:
    """Owns one task that re-reads the held callers each time the store's change feed returns."""

    def __init__(self, store: TaskStore, waiters: ReplyWaiters, *, name: str = "gateway") -> None:
        self._store = store
        self._waiters = waiters
        self._returned = asyncio.Event()
        self._loop = BackgroundLoop(f"{name}-reconnect-recheck")
        self.rechecks = 0
        """Re-checks run (one per return of the change feed, or fewer when returns come faster than reads)."""
        store.on_feed_return(self._returned.set)

    @property
    def alive(self) -> bool:
        return self._loop.alive

    def start(self) -> None:
        self._loop.start(self._run())

    async def close(self) -> None:
        await self._loop.close()

    async def _run(self) -> None:
        while True:
            await self._returned.wait()
            self._returned.clear()
            await self.recheck()

    async def recheck(self) -> int:
        """Reads the task of every caller still waiting and resolves those that ended; returns how many."""
        held = self._waiters.held()
        answered = read = 0
        for start in range(0, len(held), _CHUNK):
            chunk = held[start : start + _CHUNK]
            try:
                found = await self._store.get_many(chunk)
            except TRANSPORT_ERRORS as err:
                # The feed dropped again: its next return re-checks, and the sweep remains behind that.
                log.warning("re-reading held callers after the change feed's return failed: %s", err)
                break
            read += len(chunk)
            for state in found.values():
                if state.status.terminal:
                    self._waiters.resolve(state)
                    answered += 1
        self.rechecks += 1
        log.warning(
            "task store reachable again: re-read %d of %d held caller(s), %d had an answer whose reply was lost",
            read,
            len(held),
            answered,
        )
        return answered
