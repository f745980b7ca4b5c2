"""Tracing of the submit routes: each request's gateway spans, under the caller's ``traceparent``.

Wrapped around the endpoints only while tracing is on (``telemetry.tracing.ACTIVE`` when the
routes are registered), so with tracing off the routes run exactly as they would without it.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import GatewayError, http_status
from schemas.wire import TRACEPARENT_HEADER
from telemetry import tracing
from telemetry.spans import RequestSpans

Endpoint = Callable[[Request], Awaitable[Response]]


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
        # The OpenAI routes answer their errors instead of raising them: such an answer is a failure too.
        spans.end(status, f"answered {status}" if status >= 400 else None)
        return response

    return traced_endpoint
