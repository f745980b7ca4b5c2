"""The two submit routes, served ahead of FastAPI's middleware stack.

``POST /v1/inference`` and ``POST /v1/tasks`` carry nearly every request a busy gateway sees.
Under FastAPI they pass Starlette's error page, FastAPI's telemetry, body-limit and exit-stack
middlewares and the router before their endpoint runs, a large share of the service's CPU spent on
nothing those endpoints use. They read and bound their own body, parse
it with their own error codes, and answer every ``GatewayError`` in the one error shape. So
:class:`GatewayApp` hands them straight to their endpoint, wrapped only in the gateway's own
layers (the request counter with its JSON 500s, and the API-key check when keys are set). Each is
registered once, as a FastAPI route (which the OpenAPI document describes, and which serves it with
the lanes off); its lane is a fast path to that route's endpoint.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, cast

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.edge.handlers import gateway_error_response
from gateway.errors import GatewayError

Endpoint = Callable[[Request], Awaitable[Response]]


class GatewayApp(FastAPI):
    """FastAPI, with some POST paths served directly (see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._lanes: dict[str, ASGIApp] = {}

    def serve_directly(self, paths: Iterable[str], retry_after_s: int, wrap: Callable[[ASGIApp], ASGIApp]) -> None:
        """POSTs to these paths go to their route's endpoint inside ``wrap`` (the gateway's own middlewares)."""
        posts = {
            route.path: route
            for route in self.router.routes
            if isinstance(route, APIRoute) and route.methods is not None and "POST" in route.methods
        }
        for path in paths:
            route = posts.get(path)
            if route is None:
                raise ValueError(f"no POST route {path} to serve directly; register it first")
            self._lanes[path] = wrap(_lane(route, retry_after_s))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            method = scope["method"]
            if method == "POST":
                lane = self._lanes.get(scope["path"])
                if lane is not None:
                    scope["app"] = self
                    await lane(scope, receive, send)
                    return
            elif method == "HEAD" and self._has_get_route(scope):
                await self._head(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def _has_get_route(self, scope: Scope) -> bool:
        get = {**scope, "method": "GET"}
        return any(route.matches(get)[0] is Match.FULL for route in self.router.routes)

    async def _head(self, scope: Scope, receive: Receive, send: Send) -> None:
        """HEAD of a GET route (FastAPI routes only the methods they name): the GET's status and
        headers, without its body. The server leaves the body out for HEAD; ending the response at its
        first body message also ends a stream (SSE), which then sees the client gone."""
        ended = False

        async def headers_only(message: Message) -> None:
            nonlocal ended
            if ended:
                return
            if message["type"] == "http.response.body":
                ended = True
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await super().__call__({**scope, "method": "GET"}, receive, headers_only)


def _lane(route: APIRoute, retry_after_s: int) -> ASGIApp:
    """The route's endpoint as an ASGI app; the route itself is ``scope["route"]``, which the request
    counter labels by."""
    endpoint = cast(Endpoint, route.endpoint)

    async def serve(scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = route
        try:
            response = await endpoint(Request(scope, receive))
        except GatewayError as err:
            response = gateway_error_response(err, retry_after_s)
        await response(scope, receive, send)

    return serve
