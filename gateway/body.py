"""Reading and parsing request bodies: bounded in size, strict UTF-8, strict JSON.

The body is parsed here rather than by FastAPI's body machinery because the gateway needs its own
error codes (``invalid_json`` 400 rather than a generic 422) and because one
``model_validate_json`` call is the cheapest strict path from bytes to a typed body.
"""

from __future__ import annotations

from pydantic import ValidationError
from pydantic_core import ErrorDetails
from starlette.requests import Request

from gateway.errors import BodyTooLarge, GatewayError, InvalidJson, InvalidUtf8, ValidationFailed
from gateway.models import InferenceBody
from gateway.settings import env_name

_LIMIT_HINT = env_name("max_body_bytes")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, refusing early (Content-Length) and while streaming (chunked or lying clients)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(f"the body is {declared} bytes; the limit is {max_bytes} ({_LIMIT_HINT})")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(f"the body is over {max_bytes} bytes, the limit ({_LIMIT_HINT})")
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def parse_inference_body(body: bytes) -> InferenceBody:
    """``body`` as an :class:`InferenceBody`, or the domain error that says what to change."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidUtf8(f"the body is not valid UTF-8 (bad byte at offset {err.start}); send UTF-8 JSON") from err
    try:
        return InferenceBody.model_validate_json(text)
    except ValidationError as err:
        raise _explain(err.errors(include_url=False, include_input=False)) from err


_FIELDS = ", ".join(InferenceBody.model_fields)


def _explain(errors: list[ErrorDetails]) -> GatewayError:
    for error in errors:
        if error["type"] == "json_invalid":
            detail = error.get("ctx", {}).get("error", error["msg"])
            return InvalidJson(f'the body is not valid JSON ({detail}); send an object like {{"input": "text"}}')
    problems: list[str] = []
    for error in errors:
        loc = ".".join(str(part) for part in error["loc"])
        kind = error["type"]
        if not loc:
            problems.append('the body must be a JSON object like {"input": "text"}')
        elif kind == "missing":
            problems.append(f"field '{loc}' is required")
        elif kind == "extra_forbidden":
            problems.append(f"field '{loc}' is unknown; the fields are {_FIELDS}")
        elif kind == "string_type":
            problems.append(f"field '{loc}' must be a string")
        elif kind == "int_type":
            problems.append(f"field '{loc}' must be an integer (no quotes, no fraction)")
        else:
            problems.append(f"field '{loc}': {error['msg']}")
    return ValidationFailed("; ".join(problems))
