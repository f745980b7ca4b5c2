"""Server-sent events: the ASGI response that streams a task's states to a client.

The stream waits in the request's own task, with ``asyncio.wait``, for whichever comes first: its
next event, the client leaving, the server beginning to shut down (:class:`StreamsEnd`), or
``ping_s`` of quiet (then a keep-alive comment, so proxies keep the connection). Besides the store
watch it reads from, an open stream holds three small tasks (its next event, the watch's next
change, and a wait for the client's disconnect), and when it ends, reference counting frees all of it. No task group per
stream: one (a ping task, an exit-signal task, a disconnect task, each with its cancel scope)
costs several times as much, and cancelling it leaves reference cycles that only a full garbage
collection frees, which the gateway's tuned collector runs rarely (``batchwire.gc_tuning``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any, Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.edge.callers import disconnected
from gateway.errors import GatewayError, error_body
from schemas.records import TaskState
from transport.cancelling import cancel_and_wait

PING = b": ping\r\n\r\n"
RETRY = b"retry: 1000\r\n"
"""Opens a task stream's first event: a client whose connection drops reconnects after a second, with
the ``Last-Event-ID`` it read, and the stream resumes after that event."""
_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


def state_event(state: TaskState) -> bytes:
    """One state as an event: ``event`` its status, ``data`` its public JSON, ``id`` its rank."""
    data = json.dumps(state.to_public(), ensure_ascii=False, separators=(",", ":"))
    return f"event: {state.status.value}\r\ndata: {data}\r\nid: {state.status.rank}\r\n\r\n".encode()


def error_event(code: str, message: str) -> bytes:
    """The ``error`` event that ends a stream whose store failed mid-way."""
    return f"event: error\r\ndata: {json.dumps(error_body(code, message))}\r\n\r\n".encode()


class Events(Protocol):
    """Encoded events, closed by ``aclose`` whether or not they were read."""

    def __aiter__(self) -> Events: ...
    async def __anext__(self) -> bytes: ...
    async def aclose(self) -> None: ...


class TaskEvents:
    """A task's states as events: ``first`` (after ``RETRY``), then each of ``later`` (a started
    ``TaskReads.events``), and an ``error`` event if the store fails mid-stream. A state whose rank is
    at most ``after`` (the client's ``Last-Event-ID``) or than one already sent is skipped, so a resumed
    stream sends each status once; one that has nothing new opens with a ``PING`` at once, so that every
    stream of the gateway's carries something (a client tells an empty answer, a proxy's, from it).
    ``aclose`` closes ``later`` (its store watch)."""

    def __init__(self, first: TaskState, later: AsyncGenerator[TaskState, None], *, after: int = -1) -> None:
        self._first: TaskState | None = first
        self._later = later
        self._sent = after
        self._opening = RETRY
        self._failed = False

    def __aiter__(self) -> TaskEvents:
        return self

    async def __anext__(self) -> bytes:
        while True:
            first = self._first is not None
            if self._first is not None:
                state, self._first = self._first, None
            elif self._failed:
                raise StopAsyncIteration
            else:
                try:
                    state = await anext(self._later)
                except GatewayError as err:
                    self._failed = True
                    return self._open(error_event(err.error_code, err.message))
            if state.status.rank > self._sent:
                self._sent = state.status.rank
                return self._open(state_event(state))
            if first:  # resumed with nothing new: the stream still opens at once (RETRY comes with an event)
                return PING

    def _open(self, event: bytes) -> bytes:
        opening, self._opening = self._opening, b""
        return opening + event

    async def aclose(self) -> None:
        await self._later.aclose()


class StreamsEnd:
    """Tells every open event stream to end: the server is shutting down, and an open stream would
    hold its graceful shutdown for the whole timeout. ``end()`` may be called from a signal handler."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._future: asyncio.Future[None] | None = None
        self.ended = False

    def future(self) -> asyncio.Future[None]:
        """Done once ``end()`` was called; one future for every stream of this event loop."""
        if self._future is None:
            self._loop = asyncio.get_running_loop()
            self._future = self._loop.create_future()
            if self.ended:
                self._future.set_result(None)
        return self._future

    def end(self) -> None:
        self.ended = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_result(None)


class EventStream(Response):
    """``text/event-stream`` of the byte events ``events`` yields, until it ends, the client leaves,
    or ``end`` says the server is shutting down; a keep-alive comment after ``ping_s`` of quiet.
    ``events`` is closed on every path. HEAD gets the headers alone. ``cut`` is the last event of a
    stream the shutdown ends: none for one the client resumes (``Last-Event-ID``), an error for one it
    cannot, so the client does not take the cut for a complete end."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: Events,
        *,
        ping_s: float,
        end: StreamsEnd | None = None,
        cut: bytes = b"",
        status_code: int = 200,
    ) -> None:
        self.events = events
        self.ping_s = ping_s
        self.end = end
        self.cut = cut
        self.status_code = status_code  # FastAPI's OpenAPI reads this parameter's default
        self.background = None
        self.init_headers(_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if scope.get("method") == "HEAD":
                await send({"type": "http.response.body", "body": b""})
                return
            if await self._stream(receive, send):
                await send({"type": "http.response.body", "body": b""})
        finally:
            await self.events.aclose()

    async def _stream(self, receive: Receive, send: Send) -> bool:
        """Sends events until one of the ends; True if the client is still there to be told it ended."""
        gone = asyncio.ensure_future(disconnected(receive))
        stops: set[asyncio.Future[Any]] = {gone}
        if self.end is not None:
            stops.add(self.end.future())
        following: asyncio.Future[bytes] | None = None
        try:
            while True:
                if following is None:
                    following = asyncio.ensure_future(anext(self.events))
                done, _ = await asyncio.wait(
                    {following, *stops}, timeout=self.ping_s, return_when=asyncio.FIRST_COMPLETED
                )
                if following in done:
                    nxt, following = following, None
                    try:
                        chunk = nxt.result()
                    except StopAsyncIteration:
                        return True
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                elif done:
                    if gone in done:
                        return False
                    if self.cut:
                        await send({"type": "http.response.body", "body": self.cut, "more_body": True})
                    return True
                else:
                    await send({"type": "http.response.body", "body": PING, "more_body": True})
        finally:
            for pending in (following, gone):
                if pending is not None:
                    await cancel_and_wait(pending)
