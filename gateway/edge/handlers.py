"""Every way a request can fail, rendered as ``{"error": {"code", "message"}}``, and request counting.

Covers the gateway's own errors, FastAPI's validation errors, Starlette's HTTP exceptions (unknown
route, wrong method) and, in :class:`EdgeMiddleware`, any exception nothing else handled: a bug
becomes a logged traceback and a JSON 500, never an HTML or plain-text page.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.edge.http_limits import EDGE_ANSWERED
from gateway.errors import GatewayError, error_body, http_status, shown
from schemas.wire import REPLAYED_HEADER
from telemetry.metrics import REQUESTS

log = logging.getLogger(__name__)

_CODE_BY_HTTP_STATUS = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
    422: "validation_error",
}


def json_response(status: int, doc: Any, headers: dict[str, str] | None = None) -> Response:
    """A JSON response without FastAPI's response-model pass: the hot path builds its dict itself."""
    body = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
    return Response(body, status, headers, media_type="application/json")


def error_response(
    status: int, code: str, message: str, task_id: str | None = None, headers: dict[str, str] | None = None
) -> Response:
    return json_response(status, error_body(code, message, task_id), headers)


def gateway_error_response(exc: GatewayError, retry_after_s: int) -> Response:
    """The answer to a domain error; 429s and 503s carry ``Retry-After``, a replayed one ``Idempotent-Replayed``."""
    status = http_status(exc)
    headers = retry_headers(exc, status, retry_after_s)
    if exc.replayed:
        headers = {**(headers or {}), REPLAYED_HEADER: "true"}
    return error_response(status, exc.error_code, exc.message, exc.task_id, headers)


def retry_headers(exc: GatewayError, status: int, retry_after_s: int) -> dict[str, str] | None:
    """``Retry-After`` for a 429 or 503 (the error's own delay, else the deployment's); None otherwise."""
    if status not in (429, 503):
        return None
    return {"Retry-After": str(exc.retry_after_s or retry_after_s)}


_UNSERVED = {
    "/v1/chat/completions": "chat completions are not served (no model here has a chat template): send the "
    "conversation as one prompt to POST /v1/completions",
}
"""What a caller of an API this gateway does not serve sends instead (the OpenAI clients' chat calls)."""


def install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    """Routes every failure through the one error shape; 429s and 503s carry ``Retry-After``."""

    async def on_gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return gateway_error_response(exc, retry_after_s)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(422, "validation_error", _describe(exc.errors()))

    async def on_http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        code = _CODE_BY_HTTP_STATUS.get(exc.status_code, f"http_{exc.status_code}")
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"no route {shown(request.method)} {shown(request.url.path)}; " + _UNSERVED.get(
                request.url.path, "see /docs for the API"
            )
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names only the first route whose path matched; GET and DELETE of one path
            # are two routes, so collect the methods of every route that matches the path.
            methods: set[str] = set()
            for route in request.app.router.routes:
                match, _ = route.matches({**request.scope, "method": "__none__"})
                if match is not Match.NONE:
                    methods.update(getattr(route, "methods", None) or ())
            if "GET" in methods:
                methods.add("HEAD")  # answered for every GET route (gateway.edge.lanes)
            if methods:
                headers["Allow"] = ", ".join(sorted(methods))
            allowed = headers.get("Allow", "?")
            message = f"{shown(request.url.path)} does not take {shown(request.method)}; allowed: {allowed}"
        return error_response(exc.status_code, code, message, headers=headers)

    app.add_exception_handler(GatewayError, on_gateway_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)


def _describe(errors: Any) -> str:
    """FastAPI's validation errors as one sentence naming each parameter and what is wrong."""
    parts: list[str] = []
    for error in errors:
        loc = [str(part) for part in error.get("loc", ())]
        where = f"{loc[0]} parameter '{'.'.join(loc[1:])}'" if len(loc) > 1 else ".".join(loc) or "request"
        parts.append(f"{where}: {error.get('msg', 'is invalid')}")
    return "; ".join(parts) or "the request is invalid"


class EdgeMiddleware:
    """Counts requests by route template and status, and turns unhandled exceptions into JSON 500s.

    A plain ASGI middleware (not ``BaseHTTPMiddleware``), so it adds next to nothing, and sits
    inside Starlette's ServerErrorMiddleware, so it sees what no exception handler took.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._counters: dict[tuple[str, int], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = False

        async def watch_status(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status = message["status"]
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch_status)
        except Exception:
            if started:
                raise  # too late for a JSON answer: the server closes the connection and logs it
            log.exception("unhandled error answering %s %s", scope.get("method"), scope.get("path"))
            status = 500
            response = error_response(500, "internal_error", "the gateway failed unexpectedly; it logged the details")
            await response(scope, receive, send)
        finally:
            # Answered mid-body by the edge, which counted that answer: the app's went nowhere.
            if not scope.get(EDGE_ANSWERED):
                route = getattr(scope.get("route"), "path", "unmatched")
                counter = self._counters.get((route, status))
                if counter is None:
                    counter = self._counters[(route, status)] = REQUESTS.labels(route=route, status=str(status))
                counter.inc()
