"""Synchronous callers waiting for their task's terminal state, keyed by task id.

One reply subscription per process feeds :meth:`ReplyWaiters.resolve`; a caller registers its
future *before* its request is published, so a reply can never arrive before anyone waits for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from schemas.records import TaskState

# A waiter whose reply may be lost is looked up in the store after ``first_check_s``, then after
# twice, four times ... that delay, at most this many times it: a long backlog (every caller
# waiting for seconds) must not turn into a store read per caller per sweep.
_MAX_BACKOFF = 8


class _Waiter:
    __slots__ = ("check_at", "delay", "future")

    def __init__(self, future: asyncio.Future[TaskState], check_at: float, delay: float) -> None:
        self.future = future
        self.check_at = check_at
        self.delay = delay


class ReplyWaiters:
    def __init__(self, first_check_s: float) -> None:
        self.first_check_s = first_check_s
        self._waiting: dict[str, _Waiter] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def register(self, task_id: str, now: float) -> asyncio.Future[TaskState]:
        """A future that :meth:`resolve` completes with the task's terminal state."""
        future: asyncio.Future[TaskState] = asyncio.get_running_loop().create_future()
        self._waiting[task_id] = _Waiter(future, now + self.first_check_s, self.first_check_s)
        return future

    def discard(self, task_id: str) -> None:
        """Forgets a waiter; called on every path out of a synchronous request."""
        waiter = self._waiting.pop(task_id, None)
        if waiter is not None and waiter.future.done() and not waiter.future.cancelled():
            waiter.future.exception()  # mark retrieved: the caller may have left before reading it

    def resolve(self, state: TaskState) -> None:
        """The reply handler: hands a terminal state to whoever waits for that task, if anyone."""
        waiter = self._waiting.get(state.task_id)
        if waiter is not None and state.status.terminal and not waiter.future.done():
            waiter.future.set_result(state)

    def due(self, now: float, limit: int) -> list[str]:
        """Task ids (at most ``limit``) whose reply is late enough to look for in the store; each
        is then not due again for twice as long as before."""
        out: list[str] = []
        for task_id, waiter in self._waiting.items():
            if waiter.check_at > now or waiter.future.done():
                continue
            out.append(task_id)
            waiter.delay = min(waiter.delay * 2, self.first_check_s * _MAX_BACKOFF)
            waiter.check_at = now + waiter.delay
            if len(out) >= limit:
                break
        return out

    def fail_all(self, make_error: Callable[[], BaseException]) -> None:
        """Wakes every waiter with an error (shutdown), so none is left hanging."""
        for waiter in self._waiting.values():
            if not waiter.future.done():
                waiter.future.set_exception(make_error())
