"""Reading and parsing request bodies: bounded in size, strict UTF-8, strict JSON.

The body is parsed here rather than by FastAPI's body machinery because the gateway needs its own
error codes (``invalid_json`` 400 rather than a generic 422) and because one
``model_validate_json`` call is the cheapest strict path from bytes to a typed body.
"""

from __future__ import annotations

import itertools
import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails, from_json
from starlette.requests import ClientDisconnect, Request

from gateway.edge.models import InferenceBody
from gateway.errors import (
    BodyTooLarge,
    ClientDisconnected,
    GatewayError,
    InvalidJson,
    InvalidUtf8,
    Overloaded,
    UnsupportedMediaType,
    ValidationFailed,
    shown,
)
from gateway.settings import env_name

_LIMIT_HINT = env_name("max_body_bytes")


class BodyBudget:
    """The bytes that the bodies being read hold together, bounded (``max_body_bytes_in_flight``), and
    those of each client, bounded to its share (``GatewaySettings.body_bytes_per_client``).

    Each body takes its bytes as they come and gives them back when it is read whole (or fails): a
    request whose next bytes would pass the budget, or its client's share, is refused 503 ``overloaded``
    at once, so a crowd of connections that each send most of a large body and stall holds the budget
    at most, not ``max_connections`` times ``max_body_bytes``, and one client's crowd holds its share at
    most: the rest of the budget still reads other clients' bodies.
    """

    def __init__(self, max_bytes: int, per_client: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.per_client = max_bytes if per_client is None else per_client
        self.held = 0
        self._by_client: dict[str, int] = {}

    def take(self, size: int, client: str = "-") -> None:
        mine = self._by_client.get(client, 0)
        if mine + size > self.per_client:
            raise Overloaded(
                f"the bodies this client is sending hold {mine} bytes, its share of what this gateway reads at "
                f"once ({self.per_client}: a quarter of {env_name('max_body_bytes_in_flight')}, at least "
                f"{env_name('max_body_bytes')}); end the bodies it sends, or retry after the Retry-After delay"
            )
        if self.held + size > self.max_bytes:
            raise Overloaded(
                f"the bodies this gateway is reading hold {self.held} bytes, its limit "
                f"({env_name('max_body_bytes_in_flight')} = {self.max_bytes}); retry after the Retry-After delay"
            )
        self.held += size
        self._by_client[client] = mine + size

    def give_back(self, size: int, client: str = "-") -> None:
        self.held -= size
        left = self._by_client.get(client, 0) - size
        if left > 0:
            self._by_client[client] = left
        else:
            self._by_client.pop(client, None)


async def read_body(request: Request, max_bytes: int, budget: BodyBudget | None = None, client: str = "-") -> bytes:
    """The whole JSON body, refusing another Content-Type, a body too large early (Content-Length)
    and while streaming (chunked or lying clients), and a body the ``budget`` has no room for (or
    ``client``'s share of it: ``gateway.edge.callers.client_of``)."""
    headers = request.headers
    check_json_media_type(headers.get("content-type"))
    check_uncompressed(", ".join(headers.getlist("content-encoding")) or None)
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(f"the body is {declared} bytes; the limit is {max_bytes} ({_LIMIT_HINT})")
    chunks: list[bytes] = []
    size = taken = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise BodyTooLarge(f"the body is over {max_bytes} bytes, the limit ({_LIMIT_HINT})")
            if budget is not None:
                budget.take(len(chunk), client)
                taken = size
            chunks.append(chunk)
    except ClientDisconnect as err:  # gone, or cut off by the body timeout: no one reads the answer
        raise ClientDisconnected("the client closed the connection before its body ended") from err
    finally:
        if budget is not None:
            budget.give_back(taken, client)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def check_json_media_type(content_type: str | None) -> None:
    """Refuses a body not declared JSON: ``application/json`` or ``application/<x>+json``, any parameters.

    A web page can send a cross-site POST without a CORS preflight only as form data or text, or with
    no Content-Type at all, so none of those is read as JSON: with API keys off, a page a user opens
    cannot queue work on a gateway it reaches.
    """
    if content_type == "application/json":
        return
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json")):
        return
    shown = f"Content-Type is {content_type!r}" if content_type else "there is no Content-Type"
    raise UnsupportedMediaType(f"{shown}; send the body as JSON with Content-Type: application/json")


def check_uncompressed(content_encoding: str | None) -> None:
    """Refuses a body sent with a content coding (gzip, br, ...): bodies are read as sent, and a gzip
    body read as JSON would be refused as not UTF-8, which does not say what to change (RFC 9110 answers
    a coding the server does not take with 415)."""
    if content_encoding is None or content_encoding.strip().lower() in ("", "identity"):
        return
    raise UnsupportedMediaType(
        f"Content-Encoding is {shown(content_encoding)}; this gateway reads bodies uncompressed: send the JSON "
        "without a Content-Encoding"
    )


def parse_inference_body(body: bytes) -> InferenceBody:
    """``body`` as an :class:`InferenceBody`, or the domain error that says what to change."""
    return parse_body(body, InferenceBody)


Shape = TypeVar("Shape", bound=BaseModel)
MAX_PROBLEMS = 5
"""Problems of a body that a refusal names; the rest it counts."""
TEXT_EXPECTED = "text_expected"
"""The error type of a field validator that refuses a value which is not text, in its own words."""
_LONE_SURROGATE = ("surrogate", "end of hex escape")
"""Words of the parser's errors for a ``\\uXXXX`` escape of half a surrogate pair: JSON's grammar takes
one, Unicode has no such character, and "unexpected end of hex escape" reads as a truncated escape."""
BOM = "\ufeff"
"""A byte order mark: RFC 8259 forbids sending one, and a body that starts with one is refused naming it."""


def parse_body(body: bytes, shape: type[Shape]) -> Shape:
    """``body`` as a ``shape``, or the domain error that says what to change (``invalid_utf8``,
    ``invalid_json``, ``validation_error`` naming each field)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidUtf8(f"the body is not valid UTF-8 (bad byte at offset {err.start}); send UTF-8 JSON") from err
    if text.startswith(BOM):  # invisible in an editor: the parser's "expected value at column 1" says nothing
        raise InvalidJson(
            "the body starts with a byte order mark (U+FEFF), which JSON sent over a network does not carry; "
            f"send it without one (save the file as UTF-8 without BOM), an object like {_example(shape)}"
        )
    try:
        return shape.model_validate_json(text)
    except ValidationError as err:
        count = err.error_count()
        errors = _first_errors(text, shape) if count > MAX_PROBLEMS else None
        if errors is None:
            errors = err.errors(include_url=False, include_input=False)
        raise _explain(errors, ", ".join(shape.model_fields), _example(shape), count) from err


def _first_errors(text: str, shape: type[BaseModel]) -> list[ErrorDetails] | None:
    """The errors of a body that has more than ``MAX_PROBLEMS``, enough of them for a refusal, without
    reading each of pydantic's: a body of many unknown fields has one per field, and reading them all
    costs the event loop many times what parsing the body does.

    The body is a JSON object (one that is not has a single error): its known fields are validated again
    alone (one error each at most), and its unknown ones named, the first ``MAX_PROBLEMS`` of them.
    None for a body that is no object, whose errors are then read as they are."""
    fields = shape.model_fields
    data = from_json(text)
    if not isinstance(data, dict):
        return None
    errors: list[ErrorDetails] = []
    try:
        shape.model_validate_json(json.dumps({name: value for name, value in data.items() if name in fields}))
    except ValidationError as err:
        errors = err.errors(include_url=False, include_input=False)
    if shape.model_config.get("extra") == "forbid":
        unknown = (name for name in data if name not in fields)
        errors += [
            {"type": "extra_forbidden", "loc": (name,), "msg": "Extra inputs are not permitted", "input": None}
            for name in itertools.islice(unknown, MAX_PROBLEMS)
        ]
    return errors


def _example(shape: type[BaseModel]) -> str:
    """The least body ``shape`` takes, for a refusal's "an object like": each required field, a
    ``model`` as its placeholder and any other as text."""
    required = (name for name, field in shape.model_fields.items() if field.is_required())
    return json.dumps({name: "<model>" if name == "model" else "text" for name in sorted(required, key="model".__ne__)})


def _explain(errors: list[ErrorDetails], fields: str, example: str, count: int) -> GatewayError:
    """The refusal of a body whose validation found ``count`` errors, of which ``errors`` are the first."""
    for error in errors:
        if error["type"] == "json_invalid":
            detail = error.get("ctx", {}).get("error", error["msg"])
            if any(words in detail for words in _LONE_SURROGATE):
                at = detail.rpartition(" at ")[2]
                return InvalidJson(
                    f"the body's JSON holds a lone UTF-16 surrogate escape (\\ud800 to \\udfff without its pair) at "
                    f"{at}, which is no Unicode character; send valid Unicode text (a string cut in the middle of "
                    "an emoji has one)"
                )
            return InvalidJson(f"the body is not valid JSON ({detail}); send an object like {example}")
    problems: list[str] = []
    for error in errors:
        loc = ".".join(str(part) for part in error["loc"])
        kind = error["type"]
        if not loc:
            problems.append(f"the body must be a JSON object like {example}")
        elif kind == "missing":
            problems.append(f"field '{loc}' is required")
        elif kind == "extra_forbidden":  # the client named it: shown, never whole
            problems.append(f"field {shown(loc)} is unknown; the fields are {fields}")
        elif kind == "string_type":
            problems.append(f"field '{loc}' must be a string")
        elif kind == TEXT_EXPECTED:  # a text field's own validator: its message says what the field takes
            problems.append(f"field '{loc}' {error['msg']}")
        elif kind == "int_type":
            problems.append(f"field '{loc}' must be an integer (no quotes, no fraction)")
        else:
            problems.append(f"field '{loc}': {error['msg']}")
    if count > MAX_PROBLEMS:  # an answer never grows with what a client sent
        problems[MAX_PROBLEMS:] = [f"and {count - MAX_PROBLEMS} more"]
    return ValidationFailed("; ".join(problems))
