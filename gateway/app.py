"""The HTTP skin over :class:`~gateway.service.Gateway`: routes, lifespan, SSE, health and metrics.

The composition root builds the transports, the ``Gateway`` and a ``Lifecycle`` (which starts the
transports, and in embedded mode the batcher and workers) and hands both to :func:`create_app`.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route signatures at runtime,
# and their ``Annotated`` metadata refers to this deployment's settings (closure variables).
import re
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Annotated, Any, Protocol

from fastapi import FastAPI, Path, Query, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp

from gateway.admission import ANONYMOUS, Caller
from gateway.auth import OPEN_PATHS, ApiKeys, AuthMiddleware
from gateway.body import parse_inference_body, read_body
from gateway.errors import ERROR_TABLE, InvalidClientId, error_body
from gateway.events import EventStream, StreamsEnd, TaskEvents
from gateway.handlers import EdgeMiddleware, install_error_handlers, json_response
from gateway.health import Ready, not_ready, probe
from gateway.idempotency import KEY_PATTERN, MAX_KEY_CHARS
from gateway.lanes import GatewayApp
from gateway.models import (
    Health,
    InferenceBody,
    InferenceResponse,
    NotReadyResponse,
    Readiness,
    TaskAccepted,
    TaskResult,
    error_responses,
)
from gateway.reads import TASK_ID_PATTERN
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from schemas.wire import IDEMPOTENCY_HEADER
from telemetry.metrics import REGISTRY

CLIENT_ID_HEADER = "X-Client-Id"
_CLIENT_ID_PATTERN = re.compile(r"[\x21-\x7e]{1,128}")


class Lifecycle(Protocol):
    """What the composition root starts before the gateway and stops after it."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def ready(self) -> Mapping[str, Ready]:
        """Each part the composition root runs (transports, embedded batcher, ...) and whether it is
        ready; a ``Down`` says why not (``redis``: ``failing over``)."""
        ...


def _body_doc(settings: GatewaySettings) -> dict[str, Any]:
    """The submit body's schema with this deployment's limits, so generated clients know them.

    Documented only: the body is parsed by ``body.py`` and the limits are checked by the
    service, which answers with the specific codes (``empty_input``, ``unknown_model``, ...).
    """
    schema = InferenceBody.model_json_schema()
    schema["properties"]["input"].update(minLength=1, maxLength=settings.max_input_chars)
    schema["properties"]["model"]["anyOf"][0]["enum"] = list(settings.models)
    schema["properties"]["timeout_ms"]["anyOf"][0].update(
        minimum=settings.min_timeout_ms, maximum=settings.max_timeout_ms
    )
    parameters: list[dict[str, Any]] = [
        {
            "name": IDEMPOTENCY_HEADER,
            "in": "header",
            "required": False,
            "description": "Makes a retry safe: a submit with a key used before (by the same API key) gets the "
            "first submit's task, and nothing new is computed. Another input or model with the same key: 422 "
            "`idempotency_key_reused`. Kept as long as results (BATCHWIRE_RESULT_TTL_S). A key whose task ended "
            "without being computed (expired, cancelled, or failed before a worker took it: `unavailable`, "
            "`unknown_model`, `deadline_exceeded`) starts a new task, which the key names from then on; racing "
            "retries share that one task.",
            "schema": {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_KEY_CHARS,
                "pattern": f"^{KEY_PATTERN.pattern}$",
            },
        }
    ]
    if settings.rate_limit_per_s > 0 and settings.trust_client_id and not settings.api_keys:
        parameters.append(
            {
                "name": CLIENT_ID_HEADER,
                "in": "header",
                "required": False,
                "description": "Whose rate limit the request counts against, set by the proxy in front (else "
                "the peer's IP address).",
                "schema": {"type": "string", "minLength": 1, "maxLength": 128, "pattern": r"^[\x21-\x7e]+$"},
            }
        )
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "parameters": parameters,
    }


_SUBMIT_ERRORS = (
    "unsupported_media_type",
    "invalid_json",
    "invalid_utf8",
    "validation_error",
    "empty_input",
    "timeout_out_of_range",
    "input_too_large",
    "body_too_large",
    "unknown_model",
    "invalid_idempotency_key",
    "idempotency_key_reused",
    "overloaded",
    "unavailable",
    "not_ready",
)


def _caller_of(settings: GatewaySettings) -> Callable[[Request], Caller]:
    """How a request's caller is told: a constant when neither API keys nor rate limits are on.

    Without API keys, rate limits count per peer address. ``X-Client-Id`` chooses the bucket only
    with ``trust_client_id`` (a proxy in front sets it): a header any client may send would let
    one client spend another's bucket.
    """
    keys_on = bool(settings.api_keys)
    limits_on = settings.rate_limit_per_s > 0
    trust_client_id = settings.trust_client_id
    if not keys_on and not limits_on:
        return lambda request: ANONYMOUS

    def caller_of(request: Request) -> Caller:
        owner = _owner(request)
        if not limits_on:
            return Caller(owner)
        if owner is not None:
            return Caller(owner, f"key:{owner}")
        claimed = request.headers.get(CLIENT_ID_HEADER) if trust_client_id else None
        if claimed is not None:
            if not _CLIENT_ID_PATTERN.fullmatch(claimed):
                raise InvalidClientId(
                    f"the {CLIENT_ID_HEADER} header must be 1 to 128 visible ASCII characters (no spaces)"
                )
            return Caller(None, f"id:{claimed}")
        return Caller(None, f"ip:{request.client.host if request.client else 'unknown'}")

    return caller_of


def _owner(request: Request) -> str | None:
    """The API key's owner id that ``AuthMiddleware`` found, or None without API keys."""
    state = request.scope.get("state")
    return None if state is None else state.get("owner")


def create_app(gateway: Gateway, lifecycle: Lifecycle, streams_end: StreamsEnd | None = None) -> FastAPI:
    """The gateway's ASGI app; its lifespan starts ``lifecycle`` then ``gateway``, and stops them in reverse.

    ``streams_end``, once ended (the server began shutting down), ends every open event stream."""
    settings = gateway.settings
    body_doc = _body_doc(settings)
    task_id_doc = Path(
        description="The task_id a submit returned.",
        json_schema_extra={"pattern": f"^{TASK_ID_PATTERN.pattern}$"},
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await lifecycle.start()
        try:
            await gateway.start()
            try:
                yield
            finally:
                await gateway.close()
        finally:
            await lifecycle.close()

    app = GatewayApp(
        title="batchwire gateway",
        summary="Single inference requests in, GPU batches behind.",
        version="1",
        lifespan=lifespan,
        # A path with a trailing slash is 404, not a redirect: Starlette builds the redirect's Location
        # from the Host header, which the client chose.
        redirect_slashes=False,
        # Native OpenTelemetry wraps every request (~10 µs); batchwire exports Prometheus metrics.
        telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
    )
    install_error_handlers(app, settings.retry_after_s)
    keys = ApiKeys(settings.api_keys, settings.operator_keys) if settings.api_keys else None
    if keys is not None:
        app.add_middleware(AuthMiddleware, keys=keys)  # inside EdgeMiddleware: 401s counted
    app.add_middleware(EdgeMiddleware)
    caller_of = _caller_of(settings)
    submit_errors = _SUBMIT_ERRORS + (("rate_limited",) if settings.rate_limit_per_s > 0 else ())
    if settings.rate_limit_per_s > 0 and settings.trust_client_id:
        submit_errors += ("invalid_client_id",)

    @app.post(
        "/v1/inference",
        response_model=InferenceResponse,
        responses=error_responses(*submit_errors, "task_failed", "task_cancelled", "deadline_exceeded"),
        openapi_extra=body_doc,
        summary="Run one input and wait for its output",
        description="Holds the connection until the output is ready or `timeout_ms` passes (504; the task "
        "may still finish: poll `/v1/result/{task_id}` with the `task_id` in the error). A task that failed "
        "answers 502 with the task's own error code. A caller that closes the connection before the answer "
        "has its task cancelled, unless it sent an Idempotency-Key (then the task runs on for its retry). "
        "A retry answered from an earlier task has the header `Idempotent-Replayed: true`.",
    )
    async def infer(request: Request) -> Response:
        caller = caller_of(request)
        key = request.headers.get(IDEMPOTENCY_HEADER)
        body = parse_inference_body(await read_body(request, settings.max_body_bytes))
        answer = await gateway.submit(
            body.input,
            body.model,
            body.timeout_ms,
            True,
            caller=caller,
            idempotency_key=key,
            # Once the body is read, ASGI's receive() returns only when the client has gone, or
            # after the response was sent: what the gateway's disconnect watch needs.
            disconnected=request.receive,
        )
        return json_response(
            200,
            {
                "task_id": answer.task_id,
                "output": answer.output,
                "model": answer.model,
                "latency_ms": answer.latency_ms,
                "batch_size": answer.batch_size,
            },
            _REPLAYED if answer.replayed else None,
        )

    @app.post(
        "/v1/tasks",
        status_code=202,
        response_model=TaskAccepted,
        responses=error_responses(*submit_errors, "deadline_exceeded"),
        openapi_extra=body_doc,
        summary="Queue one input and return at once",
        description="Answers 202 with where to poll (`result_url`, also the Location header) or stream "
        "(`events_url`) the task's progress. A retry with an Idempotency-Key used before answers 202 with the "
        "earlier task (its current status) and the header `Idempotent-Replayed: true`.",
    )
    async def enqueue(request: Request) -> Response:
        caller = caller_of(request)
        key = request.headers.get(IDEMPOTENCY_HEADER)
        body = parse_inference_body(await read_body(request, settings.max_body_bytes))
        accepted = await gateway.submit(
            body.input, body.model, body.timeout_ms, False, caller=caller, idempotency_key=key
        )
        result_url = f"/v1/result/{accepted.task_id}"
        headers = {"Location": result_url}
        if accepted.replayed:
            headers.update(_REPLAYED)
        return json_response(
            202,
            {
                "task_id": accepted.task_id,
                "status": accepted.status.value,
                "result_url": result_url,
                "events_url": f"{result_url}/events",
            },
            headers,
        )

    @app.get(
        "/v1/result/{task_id}",
        response_model=TaskResult,
        responses=error_responses("invalid_task_id", "task_not_found", "validation_error", "overloaded", "unavailable"),
        summary="A task's status, and its output or error once it ended",
    )
    async def result(
        request: Request,
        task_id: Annotated[str, task_id_doc],
        wait: Annotated[
            float,
            Query(
                ge=0,
                allow_inf_nan=False,
                json_schema_extra={"maximum": settings.max_wait_s},
                description="Seconds to wait for the task to end (long-poll), up to BATCHWIRE_MAX_WAIT_S; "
                "0 answers at once. The answer is the latest state, ended or not.",
            ),
        ] = 0.0,
    ) -> Response:
        state = await gateway.result(task_id, wait, owner=_owner(request))
        return json_response(200, state.to_public())

    @app.delete(
        "/v1/result/{task_id}",
        response_model=TaskResult,
        responses=error_responses("invalid_task_id", "task_not_found", "not_cancellable", "unavailable"),
        summary="Cancel a task that no worker has started",
        description="A `queued` or `batched` task ends `cancelled` and never reaches a GPU; the answer is its "
        "cancelled state (again for a task already cancelled). A task that is running or ended otherwise "
        "answers 409 `not_cancellable`. A synchronous caller waiting for the task gets 409 `task_cancelled`.",
    )
    async def cancel(request: Request, task_id: Annotated[str, task_id_doc]) -> Response:
        state = await gateway.cancel(task_id, owner=_owner(request))
        return json_response(200, state.to_public())

    @app.get(
        "/v1/result/{task_id}/events",
        response_class=EventStream,
        responses={
            200: {
                "description": "Server-sent events: the current state first, then each change; `event` is the "
                "status, `data` the task's JSON (as from /v1/result), `id` the status rank. The stream "
                'closes after the terminal event. An `error` event carries `{"error": {...}}` if the '
                "store fails mid-stream.",
                "content": {
                    "text/event-stream": {
                        "schema": {"type": "string"},
                        "example": 'event: queued\r\ndata: {"task_id":"q3bY0h2mXw1kL9aF5cZr6Q","status":"queued",'
                        '"model":"sim"}\r\nid: 0\r\n\r\n',
                    }
                },
            },
            **error_responses("invalid_task_id", "task_not_found", "validation_error", "overloaded", "unavailable"),
        },
        summary="Stream a task's status changes",
    )
    async def events(request: Request, task_id: Annotated[str, task_id_doc]) -> EventStream:
        stream = gateway.events(task_id, owner=_owner(request))
        try:
            first = await anext(stream)  # unknown id or overload: a JSON error before the stream starts
        except BaseException:
            await stream.aclose()
            raise
        return EventStream(TaskEvents(first, stream), ping_s=settings.sse_ping_s, end=streams_end)

    @app.get("/healthz", response_model=Health, summary="Liveness: 200 while the process runs")
    async def healthz() -> Response:
        return json_response(200, {"status": "ok"})

    @app.get(
        "/readyz",
        response_model=Readiness,
        responses={
            503: {"model": NotReadyResponse, "description": "`not_ready`: a part is down; `checks` says which."}
        },
        summary="Readiness: 200 when the bus, the store and every embedded part are ready",
    )
    async def readyz() -> Response:
        checks = await _lifecycle_checks(lifecycle, settings.ready_timeout_s)
        checks.update(await gateway.ready())
        models = gateway.models()  # informational: one stalled model must not turn the others away
        down = not_ready(checks)
        ok = {part: check is True for part, check in checks.items()}
        if not down:
            return json_response(200, {"status": "ready", "checks": ok, "models": models})
        named = ", ".join(
            part if checks[part] is False else f"{part} ({down[part].state}: {down[part].reason})"
            for part in sorted(down)
        )
        doc = {
            **error_body("not_ready", f"not ready: {named}"),
            "checks": ok,
            "down": {part: {"state": why.state, "reason": why.reason} for part, why in sorted(down.items())},
            "models": models,
        }
        return json_response(503, doc, {"Retry-After": str(settings.retry_after_s)})

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {
                "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
                "description": "Prometheus text exposition of every batchwire metric in this process.",
            },
            **(error_responses("forbidden") if settings.api_keys else {}),
        },
        summary="Prometheus metrics",
        description="With API keys on, only an operator key reads it (a tenant key gets 403 `forbidden`): "
        "it shows every tenant's traffic.",
    )
    async def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    def edge(lane: ASGIApp) -> ASGIApp:
        return EdgeMiddleware(lane if keys is None else AuthMiddleware(lane, keys))

    app.serve_directly({"/v1/inference": infer, "/v1/tasks": enqueue}, settings.retry_after_s, edge)
    if settings.api_keys:
        _document_bearer(app)
    return app


_REPLAYED = {"Idempotent-Replayed": "true"}


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


async def _lifecycle_checks(lifecycle: Lifecycle, timeout_s: float) -> dict[str, Ready]:
    checks: dict[str, Ready] = {}

    async def collect() -> bool:
        checks.update(await lifecycle.ready())
        return True

    if not await probe(collect(), timeout_s, "lifecycle"):
        checks["lifecycle"] = False
    return checks
