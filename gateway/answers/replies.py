"""Routing each synchronous caller's reply to it, and finding the replies that were lost.

Replies come over one subscription per process (``TaskStore.listen_replies``) into
:class:`~gateway.answers.waiters.ReplyWaiters`. A reply can be lost (PubSub keeps nothing for a subscriber
that is away), so two store reads stand behind it: the lost-reply sweep, here, reads the tasks of
callers that have waited ``reply_recheck_s`` (then with a doubling delay), and
:class:`~gateway.answers.reconnect_recheck.ReconnectRecheck` reads every held caller's task once the store's
change feed is back. The sweep also starts watching those callers' connections.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gateway.answers.reconnect_recheck import ReconnectRecheck
from gateway.answers.waiters import ReplyWaiters, Watch
from gateway.clock import Clock
from gateway.errors import TRANSPORT_ERRORS
from schemas.records import TaskState
from transport.background_loop import BackgroundLoop
from transport.ports import TaskStore

log = logging.getLogger(__name__)

_SWEEP_CHUNK = 500

LAST_LOOK_S = 0.5
"""How long a caller past its deadline may wait for the store: the read of its task (``Replies.stored_end``),
and its late record (``TaskPublisher.record_late``). Well inside a client's grace past its deadline."""


class Replies:
    """Hands each synchronous caller its task's terminal state, from the reply or, when that is lost, the store."""

    def __init__(self, store: TaskStore, clock: Clock, *, first_check_s: float, name: str) -> None:
        self._store = store
        self._clock = clock
        self._name = name
        self._waiters = ReplyWaiters(first_check_s)
        self._recheck = ReconnectRecheck(store, self._waiters, name=name)
        self._sweeper = BackgroundLoop(f"{name}-reply-sweeper")

    def __len__(self) -> int:
        return len(self._waiters)

    @property
    def watched(self) -> int:
        """Callers whose connection is watched now."""
        return self._waiters.watched

    @property
    def alive(self) -> bool:
        """Whether the sweep and the re-check both run."""
        return self._sweeper.alive and self._recheck.alive

    async def start(self) -> None:
        """Subscribes to the replies addressed to ``name``; starts the sweep and the re-check."""
        if self._sweeper.started:
            raise RuntimeError("Replies.start() called twice")
        await self._store.listen_replies(self._name, self._waiters.resolve)
        self._sweeper.start(self._sweep_forever())
        self._recheck.start()

    async def close(self, make_error: Callable[[], BaseException]) -> None:
        """Wakes the callers still held with ``make_error()``, then stops the sweep, the re-check and the
        connection watches."""
        self._waiters.fail_all(make_error)
        await self._sweeper.close()
        await self._recheck.close()
        await self._waiters.stop_watching()

    def register(self, task_id: str, now: float, watch: Watch | None = None) -> asyncio.Future[TaskState]:
        """The future the task's terminal state completes (see ``ReplyWaiters.register``)."""
        return self._waiters.register(task_id, now, watch)

    def deliver(self, state: TaskState) -> None:
        """Hands a terminal state to its caller directly, as a reply would (``gateway.sharing.collapsing``)."""
        self._waiters.resolve(state)

    async def stored_end(self, task_id: str) -> TaskState | None:
        """The task's terminal state if the store holds one, else None: read once at a caller's deadline.

        A reply that came in time can still be unread at the deadline: a process held up (SIGSTOP, a
        frozen VM, a long swap storm) runs its due timers before its reader task has dispatched what
        its socket holds, and the caller would be told "no answer" of a task that answered in time.
        The store is written before the reply is published, so one read settles it; a read that fails
        or is slow leaves the deadline's answer.
        """
        try:
            async with asyncio.timeout(LAST_LOOK_S):
                state = await self._store.get(task_id)
        except (TimeoutError, *TRANSPORT_ERRORS):
            return None
        return state if state is not None and state.status.terminal else None

    def discard(self, task_id: str) -> None:
        """Forgets a caller; called on every path out of a synchronous request."""
        self._waiters.discard(task_id)

    async def _sweep_forever(self) -> None:
        """Resolves callers whose reply was lost, by reading their tasks from the store, and starts
        watching the connections of callers that have waited ``first_check_s``.

        Only waiters older than ``first_check_s`` are looked up (then with a doubling delay), so in
        steady state, answers well under a second, this reads nothing.
        """
        waiters = self._waiters
        while True:
            await asyncio.sleep(waiters.first_check_s)
            now = self._clock.monotonic()
            waiters.watch_callers(now)
            overdue = waiters.due(now, limit=10 * _SWEEP_CHUNK)
            for start in range(0, len(overdue), _SWEEP_CHUNK):
                try:
                    found = await self._store.get_many(overdue[start : start + _SWEEP_CHUNK])
                except TRANSPORT_ERRORS:
                    log.warning("lost-reply sweep could not read the task store; retrying", exc_info=True)
                    break
                for state in found.values():
                    waiters.resolve(state)
