"""The backend's own thread: blocking model calls run there one at a time, each under a hang limit.

A call that runs past ``hang_factor`` x its expected latency (a configured value, else the EWMA of the
recent calls that ended within theirs; never under ``hang_min_s``) is reported as ``BackendHung``; a call
that has ended never is, and one whose process was found held up (stopped, frozen, starved: its thread
with it) first gets its limit again (``HELD_UP_SHARE``), so a worker does not stop for a freeze.
Nothing can stop a stuck thread, so the runner refuses further calls and the worker gives its batch
back and is replaced (the process exits with ``EXIT_BACKEND_HUNG`` so its supervisor restarts it;
embedded mode builds a new worker over a new backend). The thread is a daemon so a stuck call never
blocks process exit.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

EXIT_BACKEND_HUNG = 75
"""Exit status of a worker process whose backend hung (EX_TEMPFAIL: restart me)."""

# Before any call was measured and with no --expected-latency-ms, a call may take this long.
FIRST_CALL_LIMIT_S = 60.0
HELD_UP_SHARE = 0.5
"""A verdict the event loop reaches this share of the limit or more past its time finds the process held
up (stopped, frozen, starved of CPU), its backend's thread with it: the call gets its limit again first."""


class NotStarted(Exception):
    """A call still waiting for the thread at its ``start_by`` was withdrawn: the thread skips it."""


class BackendExited(Exception):
    """The backend raised ``SystemExit`` or ``KeyboardInterrupt`` on its thread (model code that calls
    ``sys.exit``): the call failed. Raised as it came, asyncio would end the process with it, which in
    embedded mode serves the gateway and every other model too."""

    def __init__(self, err: BaseException) -> None:
        super().__init__(f"the backend raised {err!r}")


class BackendHung(Exception):
    """A backend call ran past its hang limit; the thread that runs it is lost. ``elapsed_s`` None: this
    call did not run, the thread being held by an earlier one that did."""

    def __init__(self, elapsed_s: float | None, limit_s: float | None, expected_s: float | None) -> None:
        expected = "no estimate yet" if expected_s is None else f"{expected_s * 1000:.0f} ms expected"
        settings = "BATCHWIRE_HANG_FACTOR, BATCHWIRE_HANG_MIN_S, BATCHWIRE_EXPECTED_LATENCY_MS"
        if elapsed_s is None or limit_s is None:
            said = "the backend's thread is still held by an earlier call that ran past its hang limit"
            super().__init__(f"{said} ({expected}; {settings}); this call did not run")
        else:
            said = f"the backend call has run {elapsed_s:.1f} s, past its hang limit of {limit_s:.1f} s"
            super().__init__(f"{said} ({expected}; {settings})")


@dataclass(slots=True)
class Timing:
    """When a call really ran, set by the backend's thread (a call may wait behind the one before)."""

    started: float | None = None
    ended: float | None = None
    cpu_s: float | None = None
    """CPU seconds the backend's thread used during the call (``time.thread_time``): a model's own
    compute on CPU with one torch thread, the Python around a GPU's kernels; threads that a library
    starts for itself are not counted."""


_Job = tuple[Callable[..., Any], tuple[Any, ...], "Future[Any]", Timing]


class BackendRunner:
    """One daemon thread serving backend calls in order, with a hang limit per call."""

    def __init__(
        self,
        name: str,
        *,
        hang_factor: float = 10.0,
        hang_min_s: float = 5.0,
        expected_s: float | None = None,
        ewma_alpha: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hang_factor = hang_factor
        self.hang_min_s = hang_min_s
        self.configured_s = expected_s
        self.ewma_alpha = ewma_alpha
        self.clock = clock
        self.ewma_s: float | None = None
        self.hung = False
        self.running = False
        """A call (or the load) runs on the thread now: the backend must not be closed under it."""
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def expected_s(self) -> float | None:
        return self.configured_s if self.configured_s is not None else self.ewma_s

    def start_from(self, call_s: float) -> None:
        """Takes ``call_s``, another runner's expected call time for this model (measured, or configured),
        when this one has timed no call: a worker that replaces one that hung first runs the batch it hung
        on, and with no estimate would allow that call ``FIRST_CALL_LIMIT_S``, past the deadlines of the
        inputs that shared it."""
        if self.ewma_s is None:
            self.ewma_s = call_s

    def limit_s(self) -> float | None:
        """How long the next call may take before it counts as hung; None when hang detection is off."""
        if self.hang_factor <= 0:
            return None
        expected = self.expected_s
        if expected is None:
            return max(self.hang_min_s, FIRST_CALL_LIMIT_S)
        return max(self.hang_min_s, self.hang_factor * expected)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, future, timing = job
            if not future.set_running_or_notify_cancel():
                continue
            self.running = True
            timing.started = self.clock()
            cpu_from = time.thread_time()
            try:
                result = fn(*args)
            except BaseException as err:  # handed to the awaiting coroutine, which decides
                timing.cpu_s, timing.ended = time.thread_time() - cpu_from, self.clock()
                self.running = False
                if not isinstance(err, SystemExit | KeyboardInterrupt):
                    future.set_exception(err)
                else:
                    escaped = BackendExited(err)
                    escaped.__cause__ = err
                    future.set_exception(escaped)
            else:
                timing.cpu_s, timing.ended = time.thread_time() - cpu_from, self.clock()
                self.running = False
                future.set_result(result)

    def _submit(
        self, fn: Callable[..., T], *args: Any, timing: Timing | None = None
    ) -> tuple[asyncio.Future[T], Future[T]]:
        future: Future[T] = Future()
        self._jobs.put((fn, args, future, Timing() if timing is None else timing))
        wrapped = asyncio.wrap_future(future)
        # A call given up on (hung, or its caller cancelled) may still end in an error nobody awaits.
        wrapped.add_done_callback(_retrieve)
        return wrapped, future

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs ``fn`` on the thread with no hang limit (loading weights)."""
        return await asyncio.shield(self._submit(fn, *args)[0])

    async def call(
        self, fn: Callable[..., T], *args: Any, timing: Timing | None = None, start_by: float | None = None
    ) -> T:
        """Runs ``fn`` on the thread; raises ``BackendHung`` once it overruns the limit (it keeps running).

        ``timing``, if given, gets when the call really ran. Calls queue in order: one submitted while
        another runs starts the moment that one ends, with no wait for the event loop, and its limit
        counts from then. One still waiting at ``start_by`` (this runner's clock) is withdrawn and
        raises ``NotStarted``: its caller decides what still runs, behind the call that overran. One
        whose caller is cancelled before the thread takes it never runs.
        """
        if self.hung:
            raise BackendHung(None, None, self.expected_s)
        limit = self.limit_s()
        timing = Timing() if timing is None else timing
        running, queued = self._submit(fn, *args, timing=timing)
        held_s = 0.0  # past the limit: the time the call gets again for a process seen held up
        try:
            while True:
                since = timing.started if timing.started is not None else self.clock()
                until = None if limit is None else since + limit + held_s
                if timing.started is None and start_by is not None:
                    until = start_by if until is None else min(until, start_by)
                try:
                    async with asyncio.timeout(None if until is None else until - self.clock()):
                        return await asyncio.shield(running)
                except TimeoutError:
                    now = self.clock()
                    if start_by is not None and now >= start_by and queued.cancel():
                        raise NotStarted from None  # the thread had not taken it: it never will
                    if timing.ended is not None:  # the thread is free, however long the call took: no hang
                        return await asyncio.shield(running)
                    started = timing.started
                    if limit is not None and until is not None and started is not None:
                        if now - started < limit + held_s:
                            continue  # not overrun: still queued when this wait was armed (by a limit or a start_by)
                        if now - until >= HELD_UP_SHARE * limit:
                            # The loop looked this late: the process was held up (SIGSTOP, a frozen or starved
                            # machine), and its backend's thread with it. Judged now, a call that ends the moment
                            # its thread runs again would be taken for a hang, and the worker would stop: it gets
                            # its limit again from now, however long the hold-up was.
                            held_s = now - started
                            continue
                        self.hung = True
                        raise BackendHung(now - started, limit, self.expected_s) from None
                    # still queued behind the call before (under a limit of its own), or it started before
                    # its start_by with no limit to overrun (detection off)
        except asyncio.CancelledError:
            queued.cancel()  # given up on before the thread took it: it never runs
            raise
        finally:
            # One that ran past its limit was held up (else it had been hung): its time is no measure of the
            # model, and averaged in it would raise the limit of the calls after it.
            if timing.started is not None and timing.ended is not None:
                ran_s = timing.ended - timing.started
                if limit is None or ran_s < limit:
                    self._observe(ran_s)

    def _observe(self, elapsed_s: float) -> None:
        if self.ewma_s is None:
            self.ewma_s = elapsed_s
        else:
            self.ewma_s += self.ewma_alpha * (elapsed_s - self.ewma_s)

    def close(self) -> None:
        """Lets the thread end after the call it runs (if any); never waits for it."""
        self._jobs.put(None)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
