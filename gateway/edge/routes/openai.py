"""OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/embeddings`` and ``POST /v1/completions``.

People call self-hosted models with the clients they already have (the ``openai`` package,
LangChain's ``OpenAIEmbeddings``, LiteLLM's ``openai/`` prefix); these routes answer them. Each
string of a request (an embeddings input, a completions prompt) is one item of a batch: a request
with 32 inputs is 32 synchronous submits that batch with other callers' items, and its answer
gathers them in order; a streamed completion sends each prompt's text as it lands. Errors take
OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: the client maps the status to its own
exceptions (429 ``RateLimitError``, 404 ``NotFoundError``) and honours ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import secrets
import struct
import time
from collections.abc import Awaitable, Iterable, Sequence
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError
from starlette.requests import Request
from starlette.responses import Response

from gateway.admission.gate import Caller
from gateway.answers.outcomes import Answer
from gateway.answers.waiters import SharedGone
from gateway.edge.body import TEXT_EXPECTED, Shape, parse_body
from gateway.edge.callers import disconnected, unless_gone
from gateway.edge.events import EventStream
from gateway.edge.handlers import json_response, retry_headers
from gateway.edge.models import error_responses
from gateway.edge.routes.deployment import deployment_of
from gateway.edge.traced import traced
from gateway.errors import (
    DeadlineExceeded,
    GatewayError,
    NotEmbeddings,
    NotReady,
    Overloaded,
    PredictedLate,
    TaskFailed,
    TimeoutBelowCall,
    UnknownModel,
    ValidationFailed,
    http_status,
    shown,
    shown_number,
)
from gateway.keys.idempotency import UNCOMPUTED_FAILURES
from gateway.service import Gateway
from gateway.settings import GatewaySettings, env_name
from schemas.records import INPUT_REFUSED
from telemetry import spans, tracing
from transport.cancelling import cancel_and_wait

T = TypeVar("T")

MODELS_PATH = "/v1/models"
EMBEDDINGS_PATH = "/v1/embeddings"
COMPLETIONS_PATH = "/v1/completions"

MAX_INPUTS = 256
"""Strings per request (embeddings inputs, completions prompts): each is an item of a batch (a batch
holds at most 100)."""

GONE_GRACE_S = 1.0
"""How long a closed stream's unanswered submits get to end as a disconnect (cancelling their tasks)
before they are cancelled where they are."""

MAX_STOPS = 4
"""Stop sequences per completions request, as OpenAI allows."""

CHARS_PER_TOKEN = 4
"""``usage`` counts tokens as characters / 4 (OpenAI's own rule of thumb): the gateway has no
tokenizer, and the workers' backends report none."""


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: None = Field(description="The parameter at fault; always null here, as in most of OpenAI's errors.")
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


def _text_or_texts(value: Any) -> Any:
    """One refusal for a value that is neither text nor token ids, instead of a line per branch of the
    field's type union (``input.str``, ``input.list[int]``, ...); token ids pass, to be refused by name."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and (
        all(isinstance(item, str) for item in value)
        or all(type(item) is int for item in value)
        or all(isinstance(item, list) and all(type(token) is int for token in item) for item in value)
    ):
        return value
    raise PydanticCustomError(TEXT_EXPECTED, "must be a string or a list of strings")


def _stop_or_stops(value: Any) -> Any:
    """As ``_text_or_texts``, for ``stop``: one refusal, not a line per branch of its type union."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    raise PydanticCustomError(TEXT_EXPECTED, "must be a string or a list of strings")


class EmbeddingsBody(BaseModel):
    """OpenAI's embeddings request; ``user`` and fields this API does not know are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    input: Annotated[str | list[str] | list[int] | list[list[int]], BeforeValidator(_text_or_texts)]
    model: str
    encoding_format: Literal["float", "base64"] | None = None
    """None (what a client sends for an option passed as None) is the default, ``float``."""
    dimensions: int | None = None


class CompletionsBody(BaseModel):
    """OpenAI's completions request. Decoding is the backend's (greedy): sampling fields
    (``temperature``, ``top_p``, ``seed``, penalties), ``max_tokens`` (the worker's
    ``--hf-max-new-tokens`` bounds every answer) and ``user`` are accepted and ignored; fields that
    would change the answer's shape and cannot be honoured are refused (``_prompts``)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    prompt: Annotated[str | list[str] | list[int] | list[list[int]], BeforeValidator(_text_or_texts)]
    model: str
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: Annotated[str | list[str] | None, BeforeValidator(_stop_or_stops)] = None
    echo: bool = False
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("stream", "echo", "n", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        """``null`` is what a client sends for an option passed as None, and OpenAI reads it as the default."""
        return cls.model_fields[str(info.field_name)].default if value is None else value


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: None
    finish_reason: Literal["stop"]


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionsResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


_SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string", "description": "A chunk's JSON, or `[DONE]`."}},
    "required": ["data"],
}
"""One event of a streamed completion, as the OpenAPI document describes it."""

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}

_NO_RETRY = {"x-should-retry": "false"}
"""What tells OpenAI's clients (openai-python, openai-node) not to retry a 5xx, which they otherwise do."""


def openai_error(exc: GatewayError, retry_after_s: int) -> Response:
    """``exc`` in OpenAI's error shape, with OpenAI's status (``_status``). A task the model itself failed
    (its error, an input that crashed workers, an output too large) fails again if sent again, and so does
    a request whose timeout, the deployment's, is shorter than one call: their answer tells the client not
    to retry."""
    status = _status(exc)
    computed = isinstance(exc, TaskFailed) and exc.task_code not in UNCOMPUTED_FAILURES
    again = computed or isinstance(exc, TimeoutBelowCall)
    return json_response(status, _error(exc), _NO_RETRY if again else retry_headers(exc, status, retry_after_s))


def _error(exc: GatewayError) -> dict[str, Any]:
    """OpenAI's error object, every field present, as its clients' types describe it."""
    return {"error": {"message": _message(exc), "type": _kind(_status(exc)), "param": None, "code": exc.error_code}}


def _status(exc: GatewayError) -> int:
    """The status OpenAI answers ``exc`` with: an unknown model is 404; an invalid request, and an input
    longer than the model takes (OpenAI's context length error), 400, which its clients raise as
    BadRequestError."""
    if exc.error_code == "unknown_model":
        return 404
    if isinstance(exc, TaskFailed) and exc.task_code in INPUT_REFUSED:
        return 400
    status = http_status(exc)
    return 400 if status == 422 else status


def _message(exc: GatewayError) -> str:
    """``exc``'s message for a caller of these routes, which give no task id to poll and take no timeout."""
    if isinstance(exc, TimeoutBelowCall):
        return (
            f"the deployment's timeout ({env_name('default_timeout_ms')}, the gateway's --default-timeout-ms; these "
            f"routes take no timeout_ms) is shorter than one call of model {exc.model!r} (about {exc.call_ms} ms), "
            "so no answer can be in time and sending the request again fails again: the operator must raise it "
            f"above {exc.call_ms}"
        )
    if isinstance(exc, DeadlineExceeded):
        return (
            f"no answer within the deployment's timeout ({env_name('default_timeout_ms')}): "
            "send the request again once the model is less busy"
        )
    if isinstance(exc, PredictedLate):
        return (
            f"model {exc.model!r}: its answers are predicted in about {exc.answer_s:.1f} s, past the deployment's "
            f"timeout ({env_name('default_timeout_ms')}={exc.timeout_ms}), so the request was refused and its strings "
            "still waiting were cancelled: retry after the Retry-After delay (each string of a request adds to that "
            "wait: send fewer per request)"
        )
    return exc.message


def _kind(status: int) -> str:
    """OpenAI's error ``type`` for a status."""
    return "server_error" if status >= 500 else _TYPES.get(status, "invalid_request_error")


async def models(request: Request) -> Response:
    """The deployment's models, as OpenAI lists its own."""
    settings = deployment_of(request).gateway.settings
    return json_response(200, {"object": "list", "data": [_card(m) for m in settings.models]})


async def retrieve_model(request: Request) -> Response:
    """One of the deployment's models, as OpenAI retrieves its own; any other is 404 ``unknown_model``."""
    settings = deployment_of(request).gateway.settings
    name: str = request.path_params["model"]
    if name not in settings.models:
        served = ", ".join(settings.models)
        unknown = UnknownModel(f"model {shown(name)} is not served here; served models: {served}")
        return openai_error(unknown, settings.retry_after_s)
    return json_response(200, _card(name))


def _card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "batchwire"}


async def _read(request: Request, shape: type[Shape]) -> tuple[Caller, Shape]:
    """The caller (its API key checked) and the request's body as ``shape``."""
    deployment = deployment_of(request)
    caller = deployment.caller_of(request)
    return caller, parse_body(await deployment.body_of(request, caller), shape)


async def embeddings(request: Request) -> Response:
    deployment = deployment_of(request)
    gateway = deployment.gateway
    try:
        caller, body = await _read(request, EmbeddingsBody)
        texts = _texts(body)
        names = _names("input", len(texts), listed=isinstance(body.input, list))
        weights = await gateway.charge(caller, texts, body.model, names)
        answers = await _refunded(
            _submit_all(gateway, texts, names, weights, body.model, caller, request), gateway, caller, len(texts)
        )
        model = answers[0].model
        vectors = [_vector(answer.output, model) for answer in answers]
    except GatewayError as exc:
        return openai_error(exc, gateway.settings.retry_after_s)
    tokens = sum(_tokens(text) for text in texts)
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


async def completions(request: Request) -> Response:
    deployment = deployment_of(request)
    gateway = deployment.gateway
    try:
        caller, body = await _read(request, CompletionsBody)
        prompts = _prompts(body)
        names = _names("prompt", len(prompts), listed=isinstance(body.prompt, list))
        stops = _stops(body.stop)
        weights = await gateway.charge(caller, prompts, body.model, names)
        if body.stream:
            chunks = CompletionChunks(gateway, prompts, names, body, stops, caller, weights)
            try:
                # An error before anything was answered is a JSON error, not a stream; a client that
                # leaves before then has its prompts' tasks cancelled, as one that leaves the stream.
                await _refunded(unless_gone(chunks.begin(), request.receive), gateway, caller, len(prompts))
            except BaseException:
                await chunks.aclose()
                raise
            return EventStream(chunks, ping_s=gateway.settings.sse_ping_s, end=deployment.streams_end, cut=CUT)
        answers = await _refunded(
            _submit_all(gateway, prompts, names, weights, body.model, caller, request), gateway, caller, len(prompts)
        )
    except GatewayError as exc:
        return openai_error(exc, gateway.settings.retry_after_s)
    model = answers[0].model
    texts = [
        _completed(prompt, answer.output, body.echo, stops) for prompt, answer in zip(prompts, answers, strict=True)
    ]
    return json_response(
        200,
        {
            "id": f"cmpl-{answers[0].task_id}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [_choice(i, text) for i, text in enumerate(texts)],
            "usage": _usage(prompts, texts, body.echo),
        },
    )


class CompletionChunks:
    """A streamed completions request's events (``gateway.edge.events.Events``): each prompt's text as
    its answer lands (OpenAI's chunk, ``index`` the prompt's), then the usage chunk if asked for, then
    ``data: [DONE]``. An error ends the stream with OpenAI's error chunk, which the client raises.
    Every prompt is submitted at construction; ``aclose`` tells the unanswered ones their caller has
    gone (their tasks are cancelled, as at a disconnect) and awaits them."""

    def __init__(
        self,
        gateway: Gateway,
        prompts: list[str],
        names: list[str],
        body: CompletionsBody,
        stops: list[str],
        caller: Caller,
        weights: Sequence[int] | None = None,
    ) -> None:
        """``names``: each prompt as an error names it (``_names``); ``weights``: each prompt's tokens, as
        ``Gateway.charge`` counted them (None: not counted)."""
        self._gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._index: dict[asyncio.Future[Answer], int] = {}
        for index, prompt in enumerate(prompts):
            submit = asyncio.ensure_future(
                gateway.submit(
                    prompt,
                    body.model,
                    None,
                    True,
                    caller=caller,
                    disconnected=SharedGone(self._gone),
                    charged=True,
                    weight=None if weights is None else weights[index],
                )
            )
            self._index[submit] = index
        self._pending = set(self._index)
        self._ready: list[asyncio.Future[Answer]] = []
        self._prompts, self._names, self._body, self._stops = prompts, names, body, stops
        self._texts: list[str] = [""] * len(prompts)
        self._id = f"cmpl-{secrets.token_urlsafe(16)}"
        self._created = int(time.time())
        self._model = body.model
        self._ended = False
        self._streaming = False
        self._first: bytes | None = None

    def __aiter__(self) -> CompletionChunks:
        return self

    async def begin(self) -> None:
        """Waits for the first chunk (the route's last chance to answer an error as a status)."""
        self._first = await self._next()

    async def __anext__(self) -> bytes:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._next()

    async def _next(self) -> bytes:
        if self._ended:
            raise StopAsyncIteration
        if not self._ready and self._pending:
            done, self._pending = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            self._ready.extend(done)
        if not self._ready:
            self._ended = True
            usage = (self._body.stream_options or {}).get("include_usage") is True
            last = _event(self._chunk([], _usage(self._prompts, self._texts, self._body.echo))) if usage else b""
            return last + b"data: [DONE]\r\n\r\n"
        submit = self._ready.pop()
        index = self._index[submit]
        try:
            answer = submit.result()
        except GatewayError as exc:
            self._ended = True
            if not self._streaming:
                raise _named(exc, self._names[index]) from None  # nothing streamed yet: the route answers it as JSON
            if tracing.ACTIVE:
                spans.request_failed(exc)
            return _error_chunk(_named(exc, self._names[index]))
        self._streaming = True
        self._model = answer.model
        text = _completed(self._prompts[index], answer.output, self._body.echo, self._stops)
        self._texts[index] = text
        return _event(self._chunk([_choice(index, text)]))

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        chunk = {"id": self._id, "object": "text_completion", "created": self._created, "model": self._model}
        return {**chunk, "choices": choices, **({"usage": usage} if usage is not None else {})}

    async def aclose(self) -> None:
        if not self._ended and self._streaming and tracing.ACTIVE:
            spans.request_failed("the stream ended before its last answer (its client left, or the gateway shut down)")
        self._ended = True
        await _abandon(self._gone, self._index)


def _prompts(body: CompletionsBody) -> list[str]:
    """The request's prompts; what cannot be honoured (``n``, ``best_of``, ``logprobs``, ``suffix``) is
    refused, saying what to send instead."""
    if body.n != 1 or (body.best_of is not None and body.best_of != 1):
        best_of = None if body.best_of is None else shown_number(body.best_of)
        raise ValidationFailed(
            f"n={shown_number(body.n)}, best_of={best_of}: decoding is greedy, so every choice would be the same; "
            "send n=1 (or leave it out) and no best_of"
        )
    if body.logprobs is not None:
        raise ValidationFailed("logprobs: batchwire's backends return text only; leave `logprobs` out")
    if body.suffix is not None:
        raise ValidationFailed("suffix: batchwire's models continue a prompt and cannot insert; leave `suffix` out")
    return _strings(body.prompt, "prompt", "Send the prompt as a string")


def _stops(stop: str | list[str] | None) -> list[str]:
    """The stop sequences: the answer is cut before the first of them."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS or not all(stops):
        raise ValidationFailed(f"`stop` holds {len(stops)} sequences; send at most {MAX_STOPS}, none empty")
    return stops


def _completed(prompt: str, output: str, echo: bool, stops: list[str]) -> str:
    """The choice's text: the output cut before its first stop sequence, after the prompt with ``echo``."""
    cut = min((at for stop in stops if (at := output.find(stop)) >= 0), default=len(output))
    return (prompt if echo else "") + output[:cut]


def _choice(index: int, text: str) -> dict[str, Any]:
    return {"text": text, "index": index, "logprobs": None, "finish_reason": "stop"}


def _usage(prompts: list[str], texts: list[str], echo: bool) -> dict[str, int]:
    """Token estimates; an echoed prompt counts once, as the prompt's, as OpenAI counts it."""
    prompt_tokens = sum(_tokens(prompt) for prompt in prompts)
    completion_tokens = sum(
        _tokens(text[len(prompt) :] if echo else text) for prompt, text in zip(prompts, texts, strict=True)
    )
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def _event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\r\n\r\n".encode()


def _error_chunk(exc: GatewayError) -> bytes:
    """OpenAI's error chunk, which ends a stream: the client raises it."""
    return _event(_error(exc))


CUT = _error_chunk(NotReady("the server is shutting down before every prompt was answered; send the request again"))
"""The last chunk of a completions stream the server's shutdown ends: a client cannot resume it."""


async def _refunded(submits: Awaitable[T], gateway: Gateway, caller: Caller, inputs: int) -> T:
    """``submits``' outcome; a refusal by the queue or a gateway closing (503) gives the request's
    ``inputs`` rate-limit tokens back, as a single request refused so takes none."""
    try:
        return await submits
    except (Overloaded, NotReady):
        await gateway.refund(caller, inputs)
        raise


async def _submit_all(
    gateway: Gateway,
    texts: list[str],
    names: list[str],
    weights: Sequence[int] | None,
    model: str | None,
    caller: Caller,
    request: Request,
) -> list[Answer]:
    """Every string submitted at once (their rate-limit tokens already taken, and ``weights`` their tokens
    counted: ``Gateway.charge``) and waited for together; the first error ends the request (the others'
    callers are gone, as at a disconnect: their tasks are cancelled), naming its string (``names``). One
    watch of the connection serves every submit."""
    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # the client left, or an error
    receiving = asyncio.ensure_future(disconnected(request.receive))
    receiving.add_done_callback(lambda _: None if gone.done() else gone.set_result(None))

    submits = [
        asyncio.ensure_future(
            gateway.submit(
                text,
                model,
                None,
                True,
                caller=caller,
                disconnected=SharedGone(gone),
                charged=True,
                weight=None if weights is None else weights[index],
            )
        )
        for index, text in enumerate(texts)
    ]
    try:
        done, _ = await asyncio.wait(submits, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        await cancel_and_wait(receiving)
        await _abandon(gone, submits)
    for index, submit in enumerate(submits):
        if submit in done and not submit.cancelled() and (error := submit.exception()) is not None:
            raise _named(error, names[index]) if isinstance(error, GatewayError) else error
    return [submit.result() for submit in submits]


def _named(error: GatewayError, name: str) -> GatewayError:
    """``error`` of one string's task, its message led by the string's ``name`` (```prompt[2]```): the task's
    own message (the model's limit, its failure) says "input", and a request holds up to 256 strings."""
    if not isinstance(error, TaskFailed):
        return error
    return TaskFailed(
        f"{name}: {error.message}", task_id=error.task_id or "", task_code=error.task_code, replayed=error.replayed
    )


async def _abandon(gone: asyncio.Future[None], submits: Iterable[asyncio.Future[Answer]]) -> None:
    """Tells the submits not yet ended that their caller has gone (``gone``: what they watch), so their
    tasks are cancelled; one still in admission watches nothing yet, and is cancelled where it is after
    ``GONE_GRACE_S``. Every submit's error is retrieved, so none logs "exception was never retrieved"."""
    if not gone.done():
        gone.set_result(None)
    pending = [submit for submit in submits if not submit.done()]
    if pending:
        _, waiting = await asyncio.wait(pending, timeout=GONE_GRACE_S)
        await asyncio.gather(*(cancel_and_wait(submit) for submit in waiting))
    for submit in submits:
        if not submit.cancelled():
            submit.exception()


def _texts(body: EmbeddingsBody) -> list[str]:
    """The request's strings; ``dimensions`` is refused, saying what to send."""
    if body.dimensions is not None:
        raise ValidationFailed(
            f"dimensions={shown_number(body.dimensions)}: batchwire's models return their full vectors and cannot "
            "truncate; leave `dimensions` out"
        )
    return _strings(
        body.input,
        "input",
        "With LangChain's OpenAIEmbeddings, set check_embedding_ctx_length=False so it sends the strings",
    )


def _strings(value: str | list[str] | list[int] | list[list[int]], field: str, hint: str) -> list[str]:
    """One string or a list of them, at most ``MAX_INPUTS``; token ids are refused (``hint``: how to send text)."""
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise ValidationFailed(f"`{field}` is an empty list; send at least one string")
    if not all(isinstance(text, str) for text in texts):
        raise ValidationFailed(f"`{field}` holds token ids: batchwire takes text. {hint}")
    if len(texts) > MAX_INPUTS:
        raise ValidationFailed(f"`{field}` holds {len(texts)} strings; send at most {MAX_INPUTS} per request")
    return [str(text) for text in texts]


def _names(field: str, count: int, *, listed: bool) -> list[str]:
    """Each string as a refusal of it names it, where the caller sent it (```prompt[2]```, or ```prompt```
    for one string), not as ``/v1/inference``'s ``input``: a completions caller sent none, and a bare
    "input" leaves the caller to search up to 256 strings."""
    return [f"`{field}[{index}]`" for index in range(count)] if listed else [f"`{field}`"]


FLOAT32_MAX = 3.4028234663852886e38


def _vector(output: str, model: str) -> list[float]:
    """An embedding backend's output (a non-empty JSON array of numbers) as floats, each finite and within float32
    (what base64 packs, and what strict JSON can carry): a model whose output its input steers (one
    that generates text) may print any number."""
    try:
        vector = json.loads(output, parse_constant=_not_a_number)
        floats = [_float32(x) for x in vector] if isinstance(vector, list) and vector else None
    # ValueError: not JSON, NaN, or an int past Python's digit limit; RecursionError: arrays nested too deep
    except (ValueError, TypeError, OverflowError, RecursionError):
        floats = None
    if floats is None:
        raise NotEmbeddings(
            f"model {shown(model)} does not return embeddings (its output is not a non-empty list of finite "
            "float32 numbers); send `model` naming an embedding model (the hf backend with --hf-task embed)"
        )
    return floats


def _not_a_number(constant: str) -> float:
    raise ValueError(f"{constant} is not a number")


def _float32(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{value!r} is not a number")
    number = float(value)
    if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
        raise ValueError(f"{value!r} is not a finite float32")
    return number


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
    routes.add_api_route(
        MODELS_PATH + "/{model:path}",
        traced(retrieve_model),
        methods=["GET"],
        response_model=ModelCard,
        responses={404: {"model": OpenAIError}},
        openapi_extra={"parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]},
        summary="One of the deployment's models (OpenAI-compatible)",
        description="The model's card in OpenAI's shape; a model not served here is 404 `unknown_model`.",
    )
    text = {"type": "string", "minLength": 1, "maxLength": settings.max_input_chars}
    body = {
        "type": "object",
        "required": ["input", "model"],
        "properties": {
            "input": {"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": MAX_INPUTS}]},
            "model": {"type": "string", "enum": list(settings.models)},
            "encoding_format": {"anyOf": [{"type": "string", "enum": ["float", "base64"]}, {"type": "null"}]},
        },
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
        f"`--hf-task embed`). Each string is one item of a batch, at most {MAX_INPUTS} per request; "
        "`encoding_format` is `float` or `base64` (little-endian float32); "
        "`dimensions` and token-id inputs are refused. `usage` estimates tokens as characters / 4. Errors "
        "have OpenAI's shape; 429 and 503 carry Retry-After.",
    )
    prompt = {"type": "string", "minLength": 1, "maxLength": settings.max_input_chars}
    completions_body = {
        "type": "object",
        "required": ["prompt", "model"],
        "properties": {
            "prompt": {"anyOf": [prompt, {"type": "array", "items": prompt, "minItems": 1, "maxItems": MAX_INPUTS}]},
            "model": {"type": "string", "enum": list(settings.models)},
            "stream": {"type": ["boolean", "null"]},
            "echo": {"type": ["boolean", "null"]},
            "stop": {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOPS},
                    {"type": "null"},
                ]
            },
        },
    }
    routes.add_api_route(
        COMPLETIONS_PATH,
        traced(completions),
        methods=["POST"],
        response_model=CompletionsResponse,
        responses={
            **edge,
            **shaped,
            200: {
                "description": "The completions; with `stream`, server-sent events: one `data:` chunk per prompt "
                "as it is answered (`choices[0].index` the prompt's), then `data: [DONE]`.",
                "content": {"text/event-stream": {"schema": _SSE_EVENT}},
            },
        },
        openapi_extra={
            "requestBody": {"required": True, "content": {"application/json": {"schema": completions_body}}}
        },
        summary="Completions of one prompt or a list (OpenAI-compatible)",
        description="OpenAI's completions API for models served by a generating backend. Each prompt is one item "
        f"of a batch, at most {MAX_INPUTS} per request; decoding is greedy, bounded by the worker's "
        "`--hf-max-new-tokens` (`max_tokens` and sampling fields are accepted and ignored); `stop` cuts each "
        "answer before its first stop sequence; `echo` prepends the prompt. `n` and `best_of` above 1, "
        "`logprobs` and `suffix` are refused. `usage` estimates tokens as characters / 4. Errors have OpenAI's "
        "shape; 429 and 503 carry Retry-After.",
    )
