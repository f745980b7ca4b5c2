"""Tracing of the submit routes: each request's gateway spans, under the caller's ``traceparent``.

Wrapped around the endpoints only while tracing is on (``telemetry.tracing.ACTIVE`` when the
routes are registered), so with tracing off the routes run exactly as they would without it.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway.edge.events import Events, EventStream
from gateway.errors import GatewayError, http_status
from schemas.wire import TRACEPARENT_HEADER
from telemetry import tracing
from telemetry.spans import RequestSpans

Endpoint = Callable[[Request], Awaitable[Response]]


class _EndingSpans:
    """A streamed answer's events, which end the request's spans once the stream is closed: the answer
    is written then (or its client has left), not when the route handed the stream over."""

    def __init__(self, events: Events, spans: RequestSpans, status: int) -> None:
        self._events = events
        self._spans = spans
        self._status = status

    def __aiter__(self) -> _EndingSpans:
        return self

    async def __anext__(self) -> bytes:
        return await anext(self._events)

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            self._spans.end(self._status)


def traced(endpoint: Endpoint) -> Endpoint:
    """``endpoint`` with its request's spans (``telemetry.spans``) when tracing is on; else itself."""
    if not tracing.ACTIVE:
        return endpoint

    @functools.wraps(endpoint)
    async def traced_endpoint(request: Request) -> Response:
        spans = RequestSpans(request.headers.get(TRACEPARENT_HEADER))
        try:
            response = await endpoint(request)
        except BaseException as err:
            spans.end(http_status(err) if isinstance(err, GatewayError) else None, err)
            raise
        status = response.status_code
        if isinstance(response, EventStream):
            response.events = _EndingSpans(response.events, spans, status)
            return response
        # The OpenAI routes answer their errors instead of raising them: such an answer is a failure too.
        spans.end(status, f"answered {status}" if status >= 400 else None)
        return response

    return traced_endpoint
