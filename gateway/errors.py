"""The gateway's domain errors, and the one table that turns them into HTTP answers.

``service.py`` raises these and knows nothing of HTTP; ``edge/app.py`` renders any of them as
``{"error": {"code": ..., "message": ...}}`` with the status from :data:`HTTP_STATUS`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from schemas.records import INPUT_REFUSED
from transport.ports import TransportError

# Errors of the bus and the store: a TransportError, or a client library's connection error that
# the transport did not wrap.
TRANSPORT_ERRORS = (TransportError, OSError)


class GatewayError(Exception):
    """Base of every error the gateway answers with. ``code`` is the stable, documented name."""

    code: ClassVar[str] = "internal_error"
    retriable: ClassVar[bool] = False

    def __init__(
        self, message: str, *, task_id: str | None = None, retry_after_s: int | None = None, replayed: bool = False
    ) -> None:
        super().__init__(message)
        self.message = message
        self.task_id = task_id
        self.retry_after_s = retry_after_s
        """Seconds for the Retry-After header; None: the deployment's default (``retry_after_s``)."""
        self.replayed = replayed
        """The error is the answer of a task an earlier request with the same Idempotency-Key created."""

    @property
    def error_code(self) -> str:
        """The code the client sees; a failed task's own code can override the class's."""
        return self.code


class InvalidJson(GatewayError):
    code = "invalid_json"


class InvalidUtf8(GatewayError):
    code = "invalid_utf8"


class ValidationFailed(GatewayError):
    code = "validation_error"


class EmptyInput(GatewayError):
    code = "empty_input"


class InputTooLarge(GatewayError):
    code = "input_too_large"


class InputOverTokenBudget(GatewayError):
    code = "input_over_token_budget"


class Untokenizable(GatewayError):
    code = "untokenizable_input"


class BodyTooLarge(GatewayError):
    code = "body_too_large"


class InvalidPriority(GatewayError):
    code = "invalid_priority"


class PriorityAboveCeiling(GatewayError):
    code = "priority_above_ceiling"


class UnknownModel(GatewayError):
    code = "unknown_model"


class TimeoutOutOfRange(GatewayError):
    code = "timeout_out_of_range"


class InvalidTaskId(GatewayError):
    code = "invalid_task_id"


class TaskNotFound(GatewayError):
    code = "task_not_found"


class DeadlineExceeded(GatewayError):
    code = "deadline_exceeded"


class TimeoutBelowCall(DeadlineExceeded):
    """Deadline exceeded: a worker found the request's timeout shorter than one call of its model, so no
    answer could be in time, however often it is sent. Carries the call's length, for routes that take no
    ``timeout_ms`` to say it their way (``gateway.edge.routes.openai``)."""

    def __init__(self, message: str, *, model: str, call_ms: int, task_id: str, replayed: bool = False) -> None:
        super().__init__(message, task_id=task_id, replayed=replayed)
        self.model = model
        self.call_ms = call_ms


class TaskFailed(GatewayError):
    """The task ended without an output; the client sees the task's own error code."""

    code = "task_failed"

    def __init__(self, message: str, *, task_id: str, task_code: str | None, replayed: bool = False) -> None:
        super().__init__(message, task_id=task_id, replayed=replayed)
        self.task_code = task_code

    @property
    def error_code(self) -> str:
        return self.task_code or self.code


class TaskCancelled(GatewayError):
    """A synchronous caller's task was cancelled (DELETE) before it ran."""

    code = "task_cancelled"


class NotCancellable(GatewayError):
    """DELETE of a task that a worker started already, or that ended."""

    code = "not_cancellable"


class InvalidIdempotencyKey(GatewayError):
    code = "invalid_idempotency_key"


class IdempotencyKeyReused(GatewayError):
    """The Idempotency-Key names a task created from another body."""

    code = "idempotency_key_reused"


class InvalidLastEventId(GatewayError):
    code = "invalid_last_event_id"


class InvalidClientId(GatewayError):
    code = "invalid_client_id"


class UnsupportedMediaType(GatewayError):
    """A submit whose Content-Type is not JSON: a web page cannot send JSON cross-site without a CORS preflight."""

    code = "unsupported_media_type"


class ClientDisconnected(GatewayError):
    """The synchronous caller closed its connection before the answer; its task was cancelled, unless a key
    announced a retry."""

    code = "client_disconnected"


class Overloaded(GatewayError):
    code = "overloaded"
    retriable = True


class PredictedLate(Overloaded):
    """Overloaded: the request's answer is predicted past its deadline. Carries the figures, for routes
    that take no ``timeout_ms`` to say it their way (``gateway.edge.routes.openai``)."""

    def __init__(self, message: str, *, model: str, answer_s: float, timeout_ms: int, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.model = model
        self.answer_s = answer_s
        self.timeout_ms = timeout_ms


class NotEmbeddings(GatewayError):
    code = "not_an_embedding_model"


class RateLimited(GatewayError):
    """The client used up its token bucket; ``retry_after_s`` says when the next token comes."""

    code = "rate_limited"
    retriable = True


class Unavailable(GatewayError):
    """The request bus or the task store failed; trying again later may work."""

    code = "unavailable"
    retriable = True


class QueuedUnrecorded(Unavailable):
    """The request bus took the request, the task store did not take its record: the task may still
    run, so an Idempotency-Key stays bound to it (a retry waits for that task)."""


class NotReady(GatewayError):
    """The gateway is not started yet, or is shutting down."""

    code = "not_ready"
    retriable = True


# code -> (HTTP status, when). The one place where gateway errors meet HTTP; docs/operations.md's error
# table and the OpenAPI error responses are generated from it.
ERROR_TABLE: dict[str, tuple[int, str]] = {
    "invalid_json": (400, "The body is not one JSON document, or a string in it holds a lone UTF-16 surrogate escape."),
    "invalid_utf8": (400, "The body is not valid UTF-8."),
    "invalid_task_id": (400, "The task id has characters or a length no task id has."),
    "invalid_idempotency_key": (
        400,
        "The Idempotency-Key header is empty, over 255 characters, not visible ASCII, or sent twice.",
    ),
    "invalid_last_event_id": (
        400,
        "The Last-Event-ID header is not an event id this task's stream sent (an integer from 0 to 3); resume "
        "with the `id` of the last event read, or without the header to start over.",
    ),
    "invalid_client_id": (
        400,
        "With BATCHWIRE_TRUST_CLIENT_ID on, the X-Client-Id header is empty, over 128 characters, or not visible "
        "ASCII (without it the header is ignored).",
    ),
    "invalid_http": (400, "The request is not valid HTTP/1.1; the connection is closed."),
    "body_too_fragmented": (
        400,
        "The body came in more pieces (chunks or reads) than BATCHWIRE_MAX_BODY_BYTES / 256 (at least 1024); "
        "send it in larger chunks. The connection is closed.",
    ),
    "unauthorized": (
        401,
        "API keys are on and the Authorization: Bearer key is missing, not accepted, or sent in two headers.",
    ),
    "forbidden": (
        403,
        "`/metrics`, `/v1/fleet` or `/dashboard/events` with a tenant key: they need an operator key "
        "(`operator <key>` in the keys file).",
    ),
    "validation_error": (422, "A field is missing, unknown or of the wrong type, or a parameter is out of range."),
    "empty_input": (422, "`input` is the empty string."),
    "invalid_priority": (422, "`priority` is not one of `high`, `normal`, `low`."),
    "priority_above_ceiling": (
        403,
        "`priority` is above the API key's ceiling (set in BATCHWIRE_API_KEYS_FILE); nothing was queued.",
    ),
    "timeout_out_of_range": (422, "`timeout_ms` is outside the allowed range."),
    "input_too_large": (
        413,
        "`input` has more characters than BATCHWIRE_MAX_INPUT_CHARS, or more UTF-8 bytes than a batch carries of "
        "one input (about 1 MiB, one record on the bus).",
    ),
    "input_over_token_budget": (
        413,
        "`input` has more tokens than a whole batch may hold (BATCHWIRE_MAX_BATCH_TOKENS); send a shorter input.",
    ),
    "untokenizable_input": (400, "The model's tokenizer cannot read `input` (BATCHWIRE_MAX_BATCH_TOKENS is set)."),
    "body_too_large": (413, "The body is larger than BATCHWIRE_MAX_BODY_BYTES."),
    "idempotency_key_reused": (422, "The Idempotency-Key was used before with another input or model."),
    "unsupported_media_type": (
        415,
        "A submit's Content-Type is not `application/json` (or a `+json` type), or its body is compressed (a "
        "Content-Encoding); send uncompressed JSON with that header.",
    ),
    "headers_too_large": (
        431,
        "The request line and headers, or a chunked body's trailers, chunk sizes and extensions, are over "
        "BATCHWIRE_MAX_HEADER_BYTES; the connection is closed.",
    ),
    "request_timeout": (
        408,
        "The headers did not come within BATCHWIRE_HEADER_TIMEOUT_S, or the body within BATCHWIRE_BODY_TIMEOUT_S "
        "of them; the connection is closed.",
    ),
    "too_many_connections": (
        503,
        "The gateway holds BATCHWIRE_MAX_CONNECTIONS open connections, each of which has sent a request; the new "
        "one's request is answered unread and the connection closed; retry after Retry-After.",
    ),
    "unknown_model": (404, "`model` is not served by this deployment."),
    "not_an_embedding_model": (
        400,
        "`/v1/embeddings` named a model whose outputs are not vectors (a list of finite float32 numbers).",
    ),
    "task_not_found": (404, "No task has this id (or it expired, or another API key created it)."),
    "not_found": (404, "No route has this path."),
    "method_not_allowed": (405, "The route does not take this method."),
    "not_cancellable": (
        409,
        "DELETE of a task that is running or ended, or of a synchronous request's task recorded at its 504 (it "
        "reads queued while a worker may run it); only queued or batched tasks can be.",
    ),
    "task_cancelled": (409, "The task was cancelled (`DELETE /v1/result/{task_id}`) before a worker ran it."),
    "rate_limited": (
        429,
        "The client (API key, else the peer's IP, or X-Client-Id with BATCHWIRE_TRUST_CLIENT_ID) is over "
        "BATCHWIRE_RATE_LIMIT_PER_S with bursts of BATCHWIRE_RATE_LIMIT_BURST; retry after Retry-After.",
    ),
    "client_disconnected": (
        499,
        "The caller closed the connection before its answer; its task was cancelled (with an `Idempotency-Key` "
        "it runs on for a retry).",
    ),
    "task_failed": (
        502,
        "The task failed; the code is the task's own error code when it has one (an input its model refused "
        "is `input_too_long`, 413, or `input_empty`, 422, instead).",
    ),
    "input_too_long": (
        413,
        "The model refused `input`: it has more tokens than the model takes (the message names the limit); "
        "send a shorter input. The task ended failed.",
    ),
    "input_empty": (422, "The model refused `input`: it has no tokens. The task ended failed."),
    "deadline_exceeded": (
        504,
        "No answer (for `POST /v1/tasks`: no place in the queue) before the request's deadline (`timeout_ms`, "
        "else BATCHWIRE_DEFAULT_TIMEOUT_MS); the task may still finish. A timeout shorter than one call of the "
        "model is never met; its message names the call's length and the setting to raise.",
    ),
    "overloaded": (
        503,
        "A limit is reached, and the message names which: this gateway holds BATCHWIRE_MAX_INFLIGHT requests; the "
        "model's queue (accepted, not yet at a worker) holds BATCHWIRE_MAX_QUEUE_DEPTH (lower tiers: its "
        "fractions); the answer is predicted past the deadline (BATCHWIRE_ADMIT_BY_WAIT); the model is stalled "
        "(BATCHWIRE_STALL_S); the client is above its fair share of the model; BATCHWIRE_MAX_WATCHERS (or the "
        "client's share) streams and long-polls are open; bodies being read hold BATCHWIRE_MAX_BODY_BYTES_IN_FLIGHT; "
        "or the embedded store is full (BATCHWIRE_MAX_STORE_BYTES). Nothing was queued; retry after Retry-After.",
    ),
    "unavailable": (
        503,
        "The request bus or the task store is down, or the store refuses writes (Redis full, NOREPLICAS, MISCONF); "
        "retry after Retry-After.",
    ),
    "not_ready": (503, "The gateway is starting or shutting down, or a dependency is not ready."),
    "internal_error": (500, "A bug: the gateway logged a traceback."),
}

HTTP_STATUS: dict[str, int] = {code: status for code, (status, _) in ERROR_TABLE.items()}


def http_status(error: GatewayError) -> int:
    """The status for ``error``; keyed by class code, so a failed task's own code keeps 502, but for an
    input its model refused (``INPUT_REFUSED``): the caller's to change, and sent again it fails again."""
    if isinstance(error, TaskFailed) and error.task_code in INPUT_REFUSED:
        return HTTP_STATUS[error.task_code]
    return HTTP_STATUS.get(error.code, 500)


SHOWN_CHARS = 64


def shown(value: str, limit: int = SHOWN_CHARS) -> str:
    """``value`` as an error message quotes it: whole when short, else its first ``limit`` characters
    and its length, so an answer never grows with what a client sent (a 1 MB model name is no 1 MB 404)."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def shown_number(value: int) -> str:
    """A number a client sent, as an error message quotes it: whole when short, else as ``shown`` quotes
    a long value (JSON's integers have no bound: a 4,000-digit ``n`` is no 4 KB answer)."""
    digits = str(value)
    return digits if len(digits) <= SHOWN_CHARS else shown(digits)


def error_body(code: str, message: str, task_id: str | None = None) -> dict[str, Any]:
    """The one error shape every non-2xx answer has."""
    inner: dict[str, Any] = {"code": code, "message": message}
    if task_id is not None:
        inner["task_id"] = task_id
    return {"error": inner}
