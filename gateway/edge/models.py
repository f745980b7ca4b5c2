"""The HTTP API's JSON shapes, as pydantic models, so the OpenAPI document describes every route.

Request bodies are strict (no coercion of ``5`` into ``"5"``) and closed (an unknown field is an
error, which catches ``"timeout"`` typed for ``"timeout_ms"``). One leniency, JSON Schema's own: an
integer may be written with a zero fraction (``5000.0``), since the schema's ``integer`` type
admits it and generated clients and fuzzers send it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from gateway.errors import ERROR_TABLE, error_body

# Mirrors schemas.records.TaskStatus (a test keeps the two equal).
StatusName = Literal["queued", "batched", "running", "completed", "failed", "expired", "cancelled"]


def _integral(value: object) -> object:
    """``5000.0`` as ``5000``; anything else is left to the strict integer check."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class InferenceBody(BaseModel):
    """Body of ``POST /v1/inference`` and ``POST /v1/tasks``."""

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        json_schema_extra={
            "examples": [{"input": "hello world"}, {"input": "hello", "model": "sim", "timeout_ms": 5000}]
        },
    )

    input: str = Field(description="The text to run the model on; not empty, at most BATCHWIRE_MAX_INPUT_CHARS.")
    model: str | None = Field(None, description="A served model; leave out for the default model.")
    timeout_ms: Annotated[int | None, BeforeValidator(_integral)] = Field(
        None,
        description="How long to wait for the answer; may shorten the default (BATCHWIRE_DEFAULT_TIMEOUT_MS), "
        "never exceed BATCHWIRE_MAX_TIMEOUT_MS.",
    )
    priority: str | None = Field(
        None,
        description="The request's tier: 'high', 'normal' or 'low'; batches take higher tiers first and "
        "overload refuses lower tiers first. Leave out for the API key's default tier ('normal' without one).",
    )


class InferenceResponse(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "task_id": "q3bY0h2mXw1kL9aF5cZr6Q",
                    "output": "dlrow olleh",
                    "model": "sim",
                    "latency_ms": 41.7,
                    "batch_size": 32,
                }
            ]
        }
    )

    task_id: str
    output: str
    model: str
    latency_ms: float = Field(description="Gateway time from accepting the request to having the answer.")
    batch_size: int | None = Field(description="Size of the batch the request ran in.")


class TaskAccepted(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "task_id": "q3bY0h2mXw1kL9aF5cZr6Q",
                    "status": "queued",
                    "result_url": "/v1/result/q3bY0h2mXw1kL9aF5cZr6Q",
                    "events_url": "/v1/result/q3bY0h2mXw1kL9aF5cZr6Q/events",
                }
            ]
        }
    )

    task_id: str
    status: StatusName = Field(
        description="`queued` for a new task; `completed` for one answered from the result cache (its output "
        "is at `result_url` at once); for a retry with an Idempotency-Key, the earlier task's status."
    )
    result_url: str = Field(description="Poll here; add ?wait=<seconds> to long-poll.")
    events_url: str = Field(description="Server-sent events of every status change.")


class ErrorDetail(BaseModel):
    code: str = Field(description="Stable machine-readable code; see the error table.")
    message: str = Field(description="What went wrong and what to change.")
    task_id: str | None = Field(None, description="The task concerned, when one was created.")


class ErrorResponse(BaseModel):
    error: ErrorDetail


class TaskResult(BaseModel):
    """A task's public state, also the ``data`` of each server-sent event."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "task_id": "q3bY0h2mXw1kL9aF5cZr6Q",
                    "status": "completed",
                    "model": "sim",
                    "output": "dlrow olleh",
                    "batch_size": 32,
                },
                {"task_id": "q3bY0h2mXw1kL9aF5cZr6Q", "status": "queued", "model": "sim"},
            ]
        }
    )

    task_id: str
    status: StatusName
    model: str
    output: str | None = None
    error: ErrorDetail | None = None
    batch_size: int | None = None


class Health(BaseModel):
    status: Literal["ok"]


_MODELS_DOC = (
    "Each served model and whether its workers take work: `serving`, or `stalled` (requests wait and no batch "
    "has reached a worker for BATCHWIRE_STALL_S: every worker busy past any normal call, hung or gone, or no "
    "batcher reading its requests; its "
    "submits get 503 `overloaded`). A stalled model does not make the gateway unready for the others."
)


class Readiness(BaseModel):
    status: Literal["ready"]
    checks: dict[str, bool] = Field(description="Each part and whether it is ready.")
    models: dict[str, Literal["serving", "stalled"]] = Field(default_factory=dict, description=_MODELS_DOC)


class DownPart(BaseModel):
    state: Literal["down", "failing over"]
    reason: str = Field(description="Why, briefly: e.g. which server does not answer.")


class NotReadyResponse(BaseModel):
    error: ErrorDetail
    checks: dict[str, bool]
    down: dict[str, DownPart] = Field(
        default_factory=dict,
        description="Each part that is not ready: `failing over` while Redis Sentinel promotes a new primary.",
    )
    models: dict[str, Literal["serving", "stalled"]] = Field(default_factory=dict, description=_MODELS_DOC)


def error_responses(*codes: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for a route that can fail with ``codes``: one entry per status, an example per code."""
    by_status: dict[int, list[str]] = {}
    for code in codes:
        by_status.setdefault(ERROR_TABLE[code][0], []).append(code)
    out: dict[int | str, dict[str, Any]] = {}
    for status, status_codes in sorted(by_status.items()):
        out[status] = {
            "model": ErrorResponse,
            "description": " ".join(f"`{code}`: {ERROR_TABLE[code][1]}" for code in status_codes),
            "content": {
                "application/json": {
                    "examples": {code: {"value": error_body(code, ERROR_TABLE[code][1])} for code in status_codes}
                }
            },
        }
    return out
