"""OpenAI-compatible routes: ``GET /v1/models`` and ``POST /v1/embeddings``.

People call self-hosted models with the clients they already have (the ``openai`` package,
LangChain's ``OpenAIEmbeddings``, LiteLLM's ``openai/`` prefix); these routes answer them. Each
string of an embeddings request is one item of a batch: a request with 32 inputs is 32 synchronous
submits that batch with other callers' items, and its answer gathers them in order. Errors take
OpenAI's shape, ``{"error": {"message", "type", "code"}}``: the client maps the status to its own
exceptions (429 ``RateLimitError``, 404 ``NotFoundError``) and honours ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
from collections.abc import Awaitable
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from gateway.admission.gate import Caller
from gateway.answers.outcomes import Answer
from gateway.edge.body import parse_body, read_body
from gateway.edge.handlers import json_response, retry_headers
from gateway.edge.models import error_responses
from gateway.edge.routes.deployment import deployment_of
from gateway.edge.traced import traced
from gateway.errors import GatewayError, NotEmbeddings, ValidationFailed, http_status, shown
from gateway.service import Gateway
from gateway.settings import GatewaySettings

MODELS_PATH = "/v1/models"
EMBEDDINGS_PATH = "/v1/embeddings"

MAX_EMBEDDING_INPUTS = 256
"""Strings per embeddings request: each is an item of a batch (a batch holds at most 100)."""

CHARS_PER_TOKEN = 4
"""``usage`` counts tokens as characters / 4 (OpenAI's own rule of thumb): the gateway has no
tokenizer, and the workers' backends report none."""


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    code: str


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="Floats, or base64 of little-endian float32.")


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


_ERROR_STATUSES = (400, 404, 413, 415, 429, 502, 503, 504)
"""What ``/v1/embeddings`` answers in OpenAI's error shape (a request refused at the edge, before the
route, has batchwire's: ``error_responses``)."""


class EmbeddingsBody(BaseModel):
    """OpenAI's embeddings request; ``user`` and fields this API does not know are ignored."""

    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


def openai_error(exc: GatewayError, retry_after_s: int) -> Response:
    """``exc`` in OpenAI's error shape; an unknown model is 404, as OpenAI answers it."""
    status = http_status(exc)
    if exc.error_code == "unknown_model":
        status = 404
    elif status == 422:  # OpenAI answers an invalid request 400, and its clients raise BadRequestError
        status = 400
    kind = "server_error" if status >= 500 else _TYPES.get(status, "invalid_request_error")
    error = {"message": exc.message, "type": kind, "code": exc.error_code}
    return json_response(status, {"error": error}, retry_headers(exc, status, retry_after_s))


async def models(request: Request) -> Response:
    """The deployment's models, as OpenAI lists its own."""
    settings = deployment_of(request).gateway.settings
    return json_response(
        200,
        {
            "object": "list",
            "data": [{"id": m, "object": "model", "created": 0, "owned_by": "batchwire"} for m in settings.models],
        },
    )


async def embeddings(request: Request) -> Response:
    deployment = deployment_of(request)
    gateway = deployment.gateway
    try:
        caller = deployment.caller_of(request)
        raw = await read_body(request, gateway.settings.max_body_bytes, deployment.bodies)
        body = parse_body(raw, EmbeddingsBody)
        texts = _texts(body)
        answers = await _submit_all(gateway, texts, body.model, caller, request)
        model = answers[0].model
        vectors = [_vector(answer.output, model) for answer in answers]
    except GatewayError as exc:
        return openai_error(exc, gateway.settings.retry_after_s)
    tokens = sum(math.ceil(len(text) / CHARS_PER_TOKEN) for text in texts)
    encode = _base64 if body.encoding_format == "base64" else list
    return json_response(
        200,
        {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        },
    )


async def _submit_all(
    gateway: Gateway, texts: list[str], model: str | None, caller: Caller, request: Request
) -> list[Answer]:
    """Every string submitted at once and waited for together; the first error ends the request (the
    others' callers are gone, as at a disconnect). One watch of the connection serves every submit."""
    gone = asyncio.ensure_future(request.receive())  # once the body is read: completes when the client goes

    def watch() -> Awaitable[object]:
        return asyncio.shield(gone)

    try:
        async with asyncio.TaskGroup() as group:
            submits = [
                group.create_task(gateway.submit(text, model, None, True, caller=caller, disconnected=watch))
                for text in texts
            ]
    except BaseExceptionGroup as errors:
        first = next((e for e in errors.exceptions if isinstance(e, GatewayError)), None)
        if first is None:
            raise
        raise first from None
    finally:
        gone.cancel()
    return [submit.result() for submit in submits]


def _texts(body: EmbeddingsBody) -> list[str]:
    """The request's strings; token arrays and ``dimensions`` are refused, saying what to send."""
    if body.dimensions is not None:
        raise ValidationFailed(
            f"dimensions={body.dimensions}: batchwire's models return their full vectors and cannot truncate; "
            "leave `dimensions` out"
        )
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise ValidationFailed("`input` is an empty list; send at least one string")
    if not all(isinstance(text, str) for text in texts):
        raise ValidationFailed(
            "`input` holds token ids: batchwire takes text. With LangChain's OpenAIEmbeddings, set "
            "check_embedding_ctx_length=False so it sends the strings"
        )
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise ValidationFailed(f"`input` holds {len(texts)} strings; send at most {MAX_EMBEDDING_INPUTS} per request")
    return [str(text) for text in texts]


def _vector(output: str, model: str) -> list[float]:
    """An embedding backend's output (a JSON array of numbers) as floats."""
    try:
        vector = json.loads(output)
    except json.JSONDecodeError:
        vector = None
    if not isinstance(vector, list) or not all(isinstance(x, int | float) for x in vector):
        raise NotEmbeddings(
            f"model {shown(model)} does not return embeddings (its output is not a list of numbers); "
            "send `model` naming an embedding model (the hf backend with --hf-task embed)"
        )
    return [float(x) for x in vector]


def _base64(vector: list[float]) -> str:
    """Little-endian float32, base64: what the openai package decodes when it asked for base64."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def add_routes(routes: APIRouter, settings: GatewaySettings) -> None:
    """The OpenAI-compatible routes, documented with this deployment's models and limits."""
    routes.add_api_route(
        MODELS_PATH,
        traced(models),
        methods=["GET"],
        response_model=ModelList,
        summary="The deployment's models (OpenAI-compatible)",
        description=f"Lists {', '.join(settings.models)} in OpenAI's model-list shape.",
    )
    text = {"type": "string", "minLength": 1, "maxLength": settings.max_input_chars}
    body = {
        "type": "object",
        "required": ["input", "model"],
        "properties": {
            "input": {"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": 8}]},
            "model": {"type": "string", "enum": list(settings.models)},
            "encoding_format": {"type": "string", "enum": ["float", "base64"]},
        },
        "additionalProperties": False,
    }
    edge = error_responses("unauthorized", "method_not_allowed", "request_timeout") if settings.api_keys else {}
    shaped: dict[int | str, dict[str, Any]] = {status: {"model": OpenAIError} for status in _ERROR_STATUSES}
    routes.add_api_route(
        EMBEDDINGS_PATH,
        traced(embeddings),
        methods=["POST"],
        response_model=EmbeddingsResponse,
        responses={**edge, **shaped},
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}},
        summary="Embeddings of one string or a list (OpenAI-compatible)",
        description="OpenAI's embeddings API for models served by an embedding backend (the hf backend with "
        f"`--hf-task embed`). Each string is one item of a batch, at most {MAX_EMBEDDING_INPUTS} per request "
        "(the schema shows a few); `encoding_format` is `float` or `base64` (little-endian float32); "
        "`dimensions` and token-id inputs are refused. `usage` estimates tokens as characters / 4. Errors "
        "have OpenAI's shape; 429 and 503 carry Retry-After.",
    )
