"""The gateway's ASGI app: its lifespan, middlewares, error handlers and the routes of ``gateway.edge.routes``.

The composition root builds the transports, the ``Gateway`` and a ``Lifecycle`` (which starts the
transports, and in embedded mode the batcher and workers) and hands both to :func:`create_app`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp

from gateway.edge.auth import OPEN_PATHS, ApiKeys, AuthMiddleware
from gateway.edge.body import BodyBudget
from gateway.edge.callers import caller_of
from gateway.edge.events import StreamsEnd
from gateway.edge.handlers import EdgeMiddleware, install_error_handlers
from gateway.edge.lanes import GatewayApp
from gateway.edge.routes import events, fleet, openai, operations, submit, tasks
from gateway.edge.routes.deployment import Deployment, Lifecycle
from gateway.errors import ERROR_TABLE, error_body
from gateway.service import Gateway
from telemetry.metrics import REGISTRY
from transport.ports import Fleet

log = logging.getLogger(__name__)


def create_app(
    gateway: Gateway,
    lifecycle: Lifecycle,
    streams_end: StreamsEnd | None = None,
    fleet_store: Fleet | None = None,
    metrics: CollectorRegistry = REGISTRY,
) -> FastAPI:
    """The gateway's ASGI app; its lifespan starts ``lifecycle`` then ``gateway``, and stops them in reverse.

    ``streams_end``, once ended (the server began shutting down), ends every open event stream.
    ``fleet_store`` is where the heartbeats land that ``/v1/fleet`` and ``/dashboard`` show.
    ``metrics`` is what ``/metrics`` serves: every role's metrics where the app runs them all in its process,
    the gateway's own (``GATEWAY_EXPORTS``) beside a separate batcher and workers."""
    settings = gateway.settings
    app = GatewayApp(
        title="batchwire gateway",
        summary="Single inference requests in, GPU batches behind.",
        version="1",
        lifespan=_lifespan,
        # A path with a trailing slash is 404, not a redirect: Starlette builds the redirect's Location
        # from the Host header, which the client chose.
        redirect_slashes=False,
        # batchwire exports Prometheus metrics; native OpenTelemetry would wrap every request too.
        telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
    )
    app.state.deployment = Deployment(
        gateway,
        lifecycle,
        caller_of(settings),
        streams_end,
        BodyBudget(settings.max_body_bytes_in_flight, settings.body_bytes_per_client),
        fleet_store,
        metrics,
    )
    install_error_handlers(app, settings.retry_after_s)
    keys = ApiKeys(settings.api_keys, settings.operator_keys, settings.key_tiers) if settings.api_keys else None
    if keys is not None:
        app.add_middleware(AuthMiddleware, keys=keys)  # inside EdgeMiddleware: 401s counted
    app.add_middleware(EdgeMiddleware)
    # Added to the app's own router, not included as routers: the 405 answer and the HEAD lane read
    # each route's methods from ``app.router.routes``.
    submit.add_routes(app.router, settings)
    tasks.add_routes(app.router, settings)
    events.add_routes(app.router, settings)
    operations.add_routes(app.router, settings)
    openai.add_routes(app.router, settings)
    fleet.add_routes(app.router, settings)

    def edge(lane: ASGIApp) -> ASGIApp:
        return EdgeMiddleware(lane if keys is None else AuthMiddleware(lane, keys))

    app.serve_directly((submit.INFERENCE_PATH, submit.TASKS_PATH), settings.retry_after_s, edge)
    if keys is not None:
        _document_bearer(app)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    deployment: Deployment = app.state.deployment
    try:
        await deployment.lifecycle.start()
    except BaseException:
        # A start that failed part-way closes the parts that came up (``Parts`` closes only those).
        try:
            await deployment.lifecycle.close()
        except Exception as err:  # the start's failure is the one to tell
            log.warning("closing after the failed start failed too: %r", err)
        raise
    try:
        try:  # a start that fails part-way too: the tasks it started stop
            await deployment.gateway.start()
            yield
        finally:
            await deployment.gateway.close()
    finally:
        await deployment.lifecycle.close()


def _document_bearer(app: FastAPI) -> None:
    """Marks every route but the open ones as needing the bearer key in the OpenAPI document."""
    build = app.openapi
    unauthorized = {
        "description": f"`unauthorized`: {ERROR_TABLE['unauthorized'][1]}",
        "content": {
            "application/json": {
                "schema": {"$ref": "#/components/schemas/ErrorResponse"},
                "example": error_body("unauthorized", ERROR_TABLE["unauthorized"][1]),
            }
        },
    }

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
            schemes["apiKey"] = {"type": "http", "scheme": "bearer", "description": "An API key (BATCHWIRE_API_KEYS)."}
            for path, item in schema["paths"].items():
                if path in OPEN_PATHS:
                    continue
                for operation in item.values():
                    operation["security"] = [{"apiKey": []}]
                    operation.setdefault("responses", {})["401"] = unauthorized
        return app.openapi_schema or build()

    app.openapi = openapi  # type: ignore[method-assign]
