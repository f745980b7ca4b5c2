"""``POST /v1/inference`` (wait for the output) and ``POST /v1/tasks`` (queue and return at once).

Both are served ahead of FastAPI's middleware stack (``gateway.edge.lanes``): their endpoints take only
the request, read and bound their own body, and raise the gateway's own errors.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from gateway.admission.priority import TIER_NAMES
from gateway.edge.body import parse_inference_body
from gateway.edge.callers import CLIENT_ID_HEADER
from gateway.edge.handlers import json_response
from gateway.edge.models import InferenceBody, InferenceResponse, TaskAccepted, error_responses
from gateway.edge.routes.deployment import deployment_of
from gateway.edge.traced import traced
from gateway.errors import InvalidIdempotencyKey
from gateway.keys.idempotency import KEY_PATTERN, MAX_KEY_CHARS
from gateway.settings import GatewaySettings
from schemas.wire import IDEMPOTENCY_HEADER, REPLAYED_HEADER

INFERENCE_PATH = "/v1/inference"
TASKS_PATH = "/v1/tasks"

_REPLAYED = {REPLAYED_HEADER: "true"}

_SUBMIT_ERRORS = (
    "unsupported_media_type",
    "invalid_json",
    "invalid_utf8",
    "validation_error",
    "empty_input",
    "timeout_out_of_range",
    "invalid_priority",
    "input_too_large",
    "body_too_large",
    "unknown_model",
    "invalid_idempotency_key",
    "idempotency_key_reused",
    "overloaded",
    "unavailable",
    "not_ready",
)


def idempotency_key_of(request: Request) -> str | None:
    """The request's Idempotency-Key, None without one. Two are refused: which would name the task
    depends on their order, which a proxy that appends its own header instead of replacing the client's
    leaves to the client."""
    keys = request.headers.getlist(IDEMPOTENCY_HEADER)
    if len(keys) > 1:
        raise InvalidIdempotencyKey(
            f"this request has {len(keys)} Idempotency-Key headers; send one Idempotency-Key header"
        )
    return keys[0] if keys else None


async def infer(request: Request) -> Response:
    """Runs one input and holds the connection until its output (or its error)."""
    deployment = deployment_of(request)
    gateway = deployment.gateway
    caller = deployment.caller_of(request)
    key = idempotency_key_of(request)
    body = parse_inference_body(await deployment.body_of(request, caller))
    answer = await gateway.submit(
        body.input,
        body.model,
        body.timeout_ms,
        True,
        caller=caller,
        priority=body.priority,
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


async def enqueue(request: Request) -> Response:
    """Queues one input and answers 202 with where to follow its task."""
    deployment = deployment_of(request)
    gateway = deployment.gateway
    caller = deployment.caller_of(request)
    key = idempotency_key_of(request)
    body = parse_inference_body(await deployment.body_of(request, caller))
    accepted = await gateway.submit(
        body.input, body.model, body.timeout_ms, False, caller=caller, idempotency_key=key, priority=body.priority
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


def add_routes(routes: APIRouter, settings: GatewaySettings) -> None:
    """The two submit routes, documented with this deployment's limits and error codes."""
    body_doc = _body_doc(settings)
    submit_errors = _SUBMIT_ERRORS + (("rate_limited",) if settings.rate_limit_per_s > 0 else ())
    if settings.key_tiers:
        submit_errors += ("priority_above_ceiling",)
    if settings.trust_client_id:
        submit_errors += ("invalid_client_id",)
    routes.add_api_route(
        INFERENCE_PATH,
        traced(infer),
        methods=["POST"],
        response_model=InferenceResponse,
        responses=error_responses(
            *submit_errors, "task_failed", "input_too_long", "input_empty", "task_cancelled", "deadline_exceeded"
        ),
        openapi_extra=body_doc,
        summary="Run one input and wait for its output",
        description="Holds the connection until the output is ready or `timeout_ms` passes (504; the task "
        "may still finish: poll `/v1/result/{task_id}` with the `task_id` in the error). A task that failed "
        "answers 502 with the task's own error code. A caller that closes the connection before the answer "
        "has its task cancelled, unless it sent an Idempotency-Key (then the task runs on for its retry). "
        "A retry answered from an earlier task has the header `Idempotent-Replayed: true`.",
    )
    routes.add_api_route(
        TASKS_PATH,
        traced(enqueue),
        methods=["POST"],
        status_code=202,
        response_model=TaskAccepted,
        responses=error_responses(*submit_errors, "deadline_exceeded"),
        openapi_extra=body_doc,
        summary="Queue one input and return at once",
        description="Answers 202 with where to poll (`result_url`, also the Location header) or stream "
        "(`events_url`) the task's progress. An input whose answer the result cache holds answers 202 with its "
        "task already `completed`. A retry with an Idempotency-Key used before answers 202 with the "
        "earlier task (its current status) and the header `Idempotent-Replayed: true`.",
    )


def _body_doc(settings: GatewaySettings) -> dict[str, Any]:
    """The submit body's schema with this deployment's limits, so generated clients know them.

    Documented only: the body is parsed by ``body.py`` and the limits are checked by the
    service, which answers with the specific codes (``empty_input``, ``unknown_model``, ...).
    """
    schema = InferenceBody.model_json_schema()
    schema["properties"]["input"].update(minLength=1, maxLength=settings.max_input_chars)
    schema["properties"]["model"]["anyOf"][0]["enum"] = list(settings.models)
    schema["properties"]["priority"]["anyOf"][0]["enum"] = list(TIER_NAMES)
    schema["properties"]["timeout_ms"]["anyOf"][0].update(
        minimum=settings.min_timeout_ms, maximum=settings.max_timeout_ms
    )
    parameters = [copy.deepcopy(_IDEMPOTENCY_KEY_DOC)]
    if settings.trust_client_id and not settings.api_keys:
        parameters.append(copy.deepcopy(_CLIENT_ID_DOC))
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "parameters": parameters,
    }


_IDEMPOTENCY_KEY_DOC: dict[str, Any] = {
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

_CLIENT_ID_DOC: dict[str, Any] = {
    "name": CLIENT_ID_HEADER,
    "in": "header",
    "required": False,
    "description": "Who sent the request (whose rate limit and share of the bodies being read it counts "
    "against), set by the proxy in front (else the peer's IP address).",
    "schema": {"type": "string", "minLength": 1, "maxLength": 128, "pattern": r"^[\x21-\x7e]+$"},
}
