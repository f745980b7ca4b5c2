"""Synchronous callers waiting for their task's terminal state, keyed by task id.

One reply subscription per process feeds :meth:`ReplyWaiters.resolve`; a caller registers its
future *before* its request is published, so a reply can never arrive before anyone waits for it.

A caller that has waited ``first_check_s`` also gets its connection watched (:meth:`watch_callers`):
if it leaves, its future fails with :class:`CallerGone`, so the gateway can cancel its task. Only
callers that wait that long are watched: a watch is a task per caller, alive for the whole wait, a
cost (mostly garbage collection made more frequent by the extra live objects) that pays off only
for callers that wait long, behind a queue, and those are the ones watched. A :class:`SharedGone`
costs no task, and is watched from the start.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from schemas.records import TaskState
from transport.cancelling import cancel_and_wait

log = logging.getLogger(__name__)

# Completes when the caller's connection is gone, or after its answer was sent (ASGI's receive()
# after the body does exactly that), whichever comes first.
Watch = Callable[[], Awaitable[object]]


T = TypeVar("T")


async def unless_gone(work: Awaitable[T], gone: Watch, error: Callable[[], Exception]) -> T:
    """``work``'s result, or ``error()`` raised once ``gone`` completes first (the client left, or its
    receive channel failed): a wait must not hold what it counts against for a client that left
    (uvicorn cancels nothing)."""
    working = asyncio.ensure_future(work)
    leaving = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({working, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(leaving)
        if not working.done():
            await cancel_and_wait(working)
    if working.cancelled():
        raise error()
    return working.result()


class SharedGone:
    """The watch of the strings of one request (OpenAI's lists): a future its route sets when the client
    leaves or one string's error ends the request. Watching it costs no task, so a caller registered
    with it is watched at once: the others' tasks are cancelled as soon as the request ends."""

    __slots__ = ("_gone",)

    def __init__(self, gone: asyncio.Future[None]) -> None:
        self._gone = gone

    def __call__(self) -> Awaitable[object]:
        return asyncio.shield(self._gone)


class CallerGone(Exception):
    """Set on a synchronous caller's future when its connection closed before the answer."""


# A waiter whose reply may be lost is looked up in the store after ``first_check_s``, then after
# twice, four times ... that delay, at most this many times it: a long backlog (every caller
# waiting for seconds) must not turn into a store read per caller per sweep.
_MAX_BACKOFF = 8


class _Waiter:
    __slots__ = ("check_at", "delay", "future", "registered", "watch")

    def __init__(self, future: asyncio.Future[TaskState], registered: float, delay: float, watch: Watch | None) -> None:
        self.future = future
        self.registered = registered
        self.check_at = registered + delay
        self.delay = delay
        self.watch = watch


class ReplyWaiters:
    """Holds each synchronous caller's future, keyed by task id, until its task's terminal state."""

    def __init__(self, first_check_s: float) -> None:
        self.first_check_s = first_check_s
        self._waiting: dict[str, _Waiter] = {}
        self._watches: set[asyncio.Future[object]] = set()

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def watched(self) -> int:
        """Callers whose connection is being watched now."""
        return len(self._watches)

    def register(self, task_id: str, now: float, watch: Watch | None = None) -> asyncio.Future[TaskState]:
        """A future that :meth:`resolve` completes with the task's terminal state. ``watch``, if
        given, is started by :meth:`watch_callers` once the caller has waited ``first_check_s`` (a
        :class:`SharedGone` at once)."""
        future: asyncio.Future[TaskState] = asyncio.get_running_loop().create_future()
        waiter = self._waiting[task_id] = _Waiter(future, now, self.first_check_s, watch)
        if isinstance(watch, SharedGone):
            self._start(waiter, watch)
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

    def held(self) -> list[str]:
        """Task ids of every caller still waiting: all of them are read again after the store's change
        feed was down (``gateway.answers.reconnect_recheck``)."""
        return [task_id for task_id, waiter in self._waiting.items() if not waiter.future.done()]

    def watch_callers(self, now: float) -> int:
        """Starts watching the connection of every caller that has waited ``first_check_s`` (once
        each); returns how many watches it started.

        A watch is not cancelled when the answer comes: receive() returns once the answer was sent,
        so the watch ends by itself a moment later.
        """
        cutoff = now - self.first_check_s
        started = 0
        for waiter in self._waiting.values():
            watch = waiter.watch
            if watch is None or waiter.registered > cutoff:
                continue
            if not waiter.future.done():
                started += 1
            self._start(waiter, watch)
        return started

    def _start(self, waiter: _Waiter, watch: Watch) -> None:
        waiter.watch = None
        if waiter.future.done():
            return
        running = asyncio.ensure_future(watch())
        self._watches.add(running)
        running.add_done_callback(functools.partial(self._watch_ended, waiter.future))

    def _watch_ended(self, future: asyncio.Future[TaskState], watch: asyncio.Future[object]) -> None:
        self._watches.discard(watch)
        if watch.cancelled():
            return  # stop_watching: the gateway is closing
        if watch.exception() is not None:  # a receive channel that fails cannot carry an answer either
            log.debug("watching a caller's connection failed; counting it as gone", exc_info=watch.exception())
        if not future.done():
            future.set_exception(CallerGone())

    async def stop_watching(self) -> None:
        """Cancels the watches still running (of requests the server never finished) and waits for them."""
        watches = set(self._watches)
        for watch in watches:
            watch.cancel()
        if watches:
            await asyncio.wait(watches)

    def fail_all(self, make_error: Callable[[], BaseException]) -> None:
        """Wakes every waiter with an error (shutdown), so none is left hanging."""
        for waiter in self._waiting.values():
            if not waiter.future.done():
                waiter.future.set_exception(make_error())
