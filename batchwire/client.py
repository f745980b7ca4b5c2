"""A typed Python client of batchwire's HTTP API: synchronous inference, tasks, and their event streams.

Only callers import it: ``pip install 'batchwire[client]'`` adds httpx, which the core install lacks,
and no role imports this module (an import-linter contract in pyproject.toml). ``Client`` blocks and
``AsyncClient`` awaits; they have the same methods and share every decision, made here without I/O:
when to retry and how long to wait (:class:`Attempts`), which exception an error answer is
(:func:`error_of`), how an event stream is read and resumed (:class:`EventDecoder`, :class:`Resume`).

What it does for its callers, so that each need not learn the protocol:

- every submit carries an ``Idempotency-Key``, one per call and the same on each of its retries, so
  no retry computes the input twice: a 503 or a 429 queued nothing, and after a lost connection the
  key finds the task the first attempt created;
- a retry waits at least the answer's ``Retry-After`` (after a refused connection, ``RECONNECT_S``: a
  gateway being restarted is ridden through), plus jittered exponential backoff, and none
  starts past the call's deadline (its ``timeout``), which is also the deadline the server holds the
  request to (``timeout_ms``), and an attempt gives up on an answer still coming past that deadline
  and ``GRACE_S``; a submit with no time (a ``timeout`` of 0 or less) raises
  :class:`DeadlineExceeded` unsent;
- every answer is a typed error or the API's JSON (or event stream): a success that is not (a proxy's
  page) raises :class:`ServerError` ``invalid_answer``;
- an event stream that drops, or that the server ends before the task (BATCHWIRE_SSE_MAX_S), reconnects
  with ``Last-Event-ID``, so each status arrives once.

The routes' paths and fields are written here, not imported from ``gateway`` (which needs the
server's dependencies); ``tests/client/test_openapi_contract.py`` holds them to the server's OpenAPI
document.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from datetime import UTC
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Any, ClassVar, Literal, Self
from urllib.parse import quote

from schemas.records import TaskStatus
from schemas.wire import IDEMPOTENCY_HEADER

try:
    import httpx
except ImportError as err:  # the core install has no httpx
    raise ImportError("batchwire.client needs httpx: pip install 'batchwire[client]'") from err

__all__ = [
    "AsyncClient",
    "AsyncTask",
    "BatchwireError",
    "Client",
    "DeadlineExceeded",
    "InvalidRequest",
    "NotCancellable",
    "NotFound",
    "Overloaded",
    "ServerError",
    "Task",
    "TaskEvent",
    "TaskFailed",
    "Unauthorized",
    "Unreachable",
]

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
API_KEY_ENV = "BATCHWIRE_API_KEY"
DEFAULT_TIMEOUT_S = 30.0
"""The server's default and longest ``timeout_ms`` (BATCHWIRE_MAX_TIMEOUT_MS): a longer one is refused."""
DEFAULT_MAX_RETRIES = 5
DEFAULT_CONCURRENCY = 32

INFERENCE_PATH = "/v1/inference"
TASKS_PATH = "/v1/tasks"
RESULT_PATH = "/v1/result/{task_id}"
EVENTS_PATH = "/v1/result/{task_id}/events"
LAST_EVENT_ID_HEADER = "Last-Event-ID"
RETRY_AFTER_HEADER = "Retry-After"

POOL_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=5.0)
"""The connection pool closes no idle connection of its own accord but one idle for ``keepalive_expiry``
(under the gateway's 10 s idle close, BATCHWIRE_HEADER_TIMEOUT_S). httpcore 1.0.x can close an idle
connection it has just handed to another request (encode/httpcore#1110): a surplus keep-alive one
(httpx keeps 20 by default, fewer than ``infer_many``'s 32 calls) or one closed to make room. That
request's socket is then closed under it: it fails, or hangs until its deadline. Each call holds one
connection at most, so the connections are as many as the caller's concurrent calls."""

BASE_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
RECONNECT_S = 1.0
"""The least wait before an attempt after a refused connection or a proxy's 502 (:class:`Unreachable`), as
the gateway's event streams ask of a reconnection (``retry: 1000``): a gateway being restarted refuses
connections for seconds, longer than the backoff alone of ``DEFAULT_MAX_RETRIES`` spans (1.5 s on average)."""
GRACE_S = 1.0
"""How long past the deadline an attempt waits for its whole answer: the server answers 504 at the deadline,
and that typed answer (with the task's id) is worth more than a client-side timeout. httpx's timeouts
bound each read, not the answer, so the attempt itself is bounded too: ``AsyncClient``'s whole; ``Client``
gives up on an answer whose body is still coming then (each of its reads waits at most as long)."""
LONGEST_ATTEMPT_S = 86_400.0
"""The longest an attempt waits, whatever its call's ``timeout`` (``math.inf`` included): a socket's timeout
overflows near 292 years, and no answer takes a day (a long-poll's is ``POLL_CHUNK_S``; a longer
``timeout_ms`` than the server's longest, which this sends for an endless ``timeout``, is refused)."""
POLL_CHUNK_S = 10.0
"""The longest single long-poll: under the idle timeout of most proxies; a longer wait polls again, as it
does when a server cuts the poll to its own longest (BATCHWIRE_MAX_POLL_WAIT_S, 60 s by default)."""
POLL_EVERY_S = 0.5
"""The shortest time between two polls: a server whose longest poll is shorter than this (0: no long-polls)
answers a poll at once, and the next one waits out the rest."""
STREAM_READ_S = 60.0
"""The longest quiet an event stream's read waits out, at least: a task may sit in one status for long,
and the server pings a quiet stream only every 15 s (BATCHWIRE_SSE_PING_S)."""

Priority = Literal["high", "normal", "low"]
TERMINAL = frozenset(status.value for status in TaskStatus if status.terminal)
_RANKS = {status.value: status.rank for status in TaskStatus}


# errors -------------------------------------------------------------------------------------------
class BatchwireError(Exception):
    """An answer other than the one asked for.

    ``code`` is the server's stable error code (docs/operations.md, "Errors"); ``status`` the HTTP
    status, None when no error answer came (a task that ended without an output, an event stream's
    ``error`` event, no connection). ``retriable``: the same call may succeed later.
    """

    retriable: ClassVar[bool] = False

    def __init__(
        self,
        code: str,
        message: str,
        status: int | None = None,
        *,
        task_id: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status
        self.task_id = task_id
        """The task concerned, when one was created (a 504's task may still finish: poll it)."""
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (a process pool's failure) and copied by its fields: ``args`` holds the message alone."""
        return (_rebuilt, (type(self), dict(self.__dict__)))


def _rebuilt(kind: type[BatchwireError], fields: dict[str, Any]) -> BatchwireError:
    error = kind.__new__(kind)
    Exception.__init__(error, f"{fields['code']}: {fields['message']}")
    error.__dict__.update(fields)
    return error


class InvalidRequest(BatchwireError):
    """The request itself is refused (400, 413, 415, 422): sent again, it gets the same answer."""


class Unauthorized(BatchwireError):
    """401 or 403: the API key is missing, not accepted, or not allowed this."""


class NotFound(BatchwireError):
    """404: no such task (or another API key's), or no such model."""


class NotCancellable(BatchwireError):
    """409: the task is running or ended; only a queued or batched task can be cancelled."""


class Overloaded(BatchwireError):
    """503 or 429: nothing was queued; the same call may succeed after ``retry_after_s``."""

    retriable = True


class DeadlineExceeded(BatchwireError):
    """No answer within the call's deadline (504, or the client's own); the task may still finish."""


class TaskFailed(BatchwireError):
    """The task ended without an output: ``task_status`` is failed, expired or cancelled, ``code`` the
    task's own error code."""

    def __init__(
        self,
        code: str,
        message: str,
        status: int | None = None,
        *,
        task_id: str | None = None,
        retry_after_s: float | None = None,
        task_status: str | None = None,
    ) -> None:
        super().__init__(code, message, status, task_id=task_id, retry_after_s=retry_after_s)
        self.task_status = task_status


class ServerError(BatchwireError):
    """A 5xx the API does not define: a bug on the server, or a proxy's own answer (as a redirect is)."""


class Unreachable(BatchwireError):
    """No answer from the gateway: every attempt's connection failed (the last failure is the
    ``__cause__``), or a proxy in front of it said so (its own 502 or 504, code ``http_502`` or ``http_504``)."""

    retriable = True


_BY_CODE: dict[str, type[BatchwireError]] = {
    "unauthorized": Unauthorized,
    "forbidden": Unauthorized,
    "priority_above_ceiling": InvalidRequest,  # a 403, but a request to change, not a key to fix
    "task_not_found": NotFound,
    "unknown_model": NotFound,
    "not_found": NotFound,
    "not_cancellable": NotCancellable,
    "task_cancelled": TaskFailed,  # the 409 a synchronous caller gets when its task was cancelled
    "overloaded": Overloaded,
    "rate_limited": Overloaded,
    "unavailable": Overloaded,  # also what an event stream's ``error`` event says when the store fails
    "not_ready": Overloaded,
    "too_many_connections": Overloaded,
    "deadline_exceeded": DeadlineExceeded,
    "internal_error": ServerError,
}
"""Each of the server's codes whose meaning the client acts on (gateway/errors.py's ERROR_TABLE); any
other code is typed by its status (``_BY_STATUS``), and the API's 502's code is always a failed task's own."""
_BY_STATUS: dict[int, type[BatchwireError]] = {
    401: Unauthorized,
    403: Unauthorized,
    404: NotFound,
    409: NotCancellable,
    429: Overloaded,
    503: Overloaded,
    504: DeadlineExceeded,
}


def error_of(response: httpx.Response) -> BatchwireError:
    """The typed error of an error answer (its body read): from the ``{"error": {...}}`` body's code,
    else its status; an answer without that body (a proxy's) gets the code ``http_<status>``, and is
    no failed task or deadline even as a 502 or 504 (a proxy's Bad Gateway or Gateway Timeout: the gateway
    did not answer it, maybe within the proxy's own timeout, shorter than the call's; a retry may)."""
    status = response.status_code
    try:
        doc = response.json()
    except ValueError:
        doc = None
    detail = doc.get("error") if isinstance(doc, dict) else None
    api = isinstance(detail, dict)
    if not isinstance(detail, dict) and response.is_redirect:
        detail = {
            "code": f"http_{status}",
            "message": f"the server redirects ({status} {response.reason_phrase}) to "
            f"{response.headers.get('location')!r}, and the client follows no redirect (a POST would lose its "
            "body or be sent twice): give the client that URL as its base_url",
        }
    elif not isinstance(detail, dict):
        detail = {"code": f"http_{status}", "message": response.text[:200] or response.reason_phrase}
    return _error(detail, status, retry_after_s(response.headers.get(RETRY_AFTER_HEADER)), api=api)


def _answer(response: httpx.Response, field: str) -> dict[str, Any]:
    """A success's body, the API's JSON object with ``field``; anything else (a proxy's page answered
    200) is a :class:`ServerError`, not the caller's ``KeyError`` or ``JSONDecodeError``."""
    try:
        doc = response.json()
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or field not in doc:
        raise ServerError(
            "invalid_answer",
            f"the {response.status_code} answer is not the API's (no {field!r} in a JSON object; a proxy's "
            f"page?): {response.text[:200]!r}",
            response.status_code,
        )
    return doc


def _is_event_stream(response: httpx.Response) -> bool:
    media_type: str = response.headers.get("content-type", "")
    return media_type.partition(";")[0].strip().lower() == "text/event-stream"


def _not_events(response: httpx.Response) -> ServerError:
    """A success that is no event stream (a proxy's page answered 200): read as one it carries no event,
    and ``events`` would take it for a stream the gateway ended before the task, again for as long as it came."""
    return ServerError(
        "invalid_answer",
        f"the {response.status_code} answer is not an event stream (Content-Type "
        f"{response.headers.get('content-type')!r}; a proxy's page?): {response.text[:200]!r}",
        response.status_code,
    )


def _error(
    detail: Mapping[str, Any], status: int | None, retry_after: float | None = None, *, api: bool = True
) -> BatchwireError:
    code = str(detail.get("code", "unknown"))
    message = str(detail.get("message", ""))
    task_id = detail.get("task_id")
    task_id = task_id if isinstance(task_id, str) else None
    if not api and status in (502, 504):  # a proxy's own: its upstream, the gateway, did not answer (in time)
        kind: type[BatchwireError] = Unreachable
    elif status == 502:  # the API's: a failed task
        kind = TaskFailed
    elif code in _BY_CODE:
        kind = _BY_CODE[code]
    elif status in _BY_STATUS:
        kind = _BY_STATUS[status]
    else:
        kind = InvalidRequest if status is not None and 400 <= status < 500 else ServerError
    if kind is TaskFailed:
        task_status = "cancelled" if code == "task_cancelled" else "failed"
        return TaskFailed(code, message, status, task_id=task_id, task_status=task_status)
    return kind(code, message, status, task_id=task_id, retry_after_s=retry_after)


def _ascii_digits(value: str) -> bool:
    """Whether ``value`` is a number as the wire writes one: ``str.isdigit`` also takes "²", which ``int`` refuses,
    and more than 18 digits are no delay or event id a server sends (past 4,300 ``int`` refuses them too)."""
    return value.isascii() and value.isdigit() and len(value) <= 18


def retry_after_s(value: str | None) -> float | None:
    """A ``Retry-After`` header's seconds: ASCII digits, or an HTTP date (in UTC, a "-0000" one too, which
    ``parsedate_to_datetime`` leaves without a zone); None if absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if _ascii_digits(value):
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - time.time())


def output_of(state: Mapping[str, Any]) -> str:
    """A terminal state's output; a task that ended without one raises :class:`TaskFailed`."""
    status = str(state.get("status"))
    task_id = str(state.get("task_id"))
    if status == TaskStatus.COMPLETED.value:
        return str(state.get("output"))
    detail = state.get("error")
    code, message = status, f"task {task_id} ended {status}"
    if isinstance(detail, dict):
        code = str(detail.get("code", code))
        message = str(detail.get("message", message))
    raise TaskFailed(code, message, task_id=task_id, task_status=status)


# retries ------------------------------------------------------------------------------------------
def full_jitter(cap_s: float) -> float:
    return random.uniform(0.0, cap_s)


@dataclass
class Attempts:
    """One logical call's attempts, within its deadline (``time.monotonic()`` seconds).

    No I/O: the time comes in, the delays go out. A delay is the answer's ``Retry-After`` (if it had
    one) plus full jitter over an exponential backoff, so that callers refused together do not come
    back together; no retry starts past the deadline, nor after ``max_retries`` in a row
    (``progressed`` starts them over).
    """

    deadline: float
    max_retries: int
    jitter: Callable[[float], float] = full_jitter
    retries: int = 0

    def remaining_s(self, now: float) -> float:
        return max(0.0, self.deadline - now)

    def answer_within_s(self, now: float) -> float:
        """How long an attempt starting ``now`` may take, its answer read: the time left and ``GRACE_S``."""
        return min(self.remaining_s(now) + GRACE_S, LONGEST_ATTEMPT_S)

    def timeout_ms(self, now: float) -> int:
        """The server's deadline for an attempt starting ``now``: the call's own."""
        return max(1, math.ceil(min(self.remaining_s(now), LONGEST_ATTEMPT_S) * 1000))

    def retry_in(self, now: float, retry_after: float | None = None) -> float | None:
        """Seconds to wait before the next attempt; None: stop (retries spent, or the deadline would pass)."""
        if self.retries >= self.max_retries:
            return None
        delay = self.jitter(min(MAX_BACKOFF_S, BASE_BACKOFF_S * 2 ** min(self.retries, 64)))  # no float overflow
        if retry_after is not None:
            delay += retry_after
        if now + delay >= self.deadline:
            return None
        self.retries += 1
        return delay

    def progressed(self) -> None:
        """The call got somewhere (an event stream delivered an event, a long-poll answered): its retries
        start over."""
        self.retries = 0

    def wait_after(self, error: BatchwireError, now: float, default_s: float | None = None) -> float:
        """Seconds to wait before retrying after ``error``: its ``Retry-After``, else ``default_s``, plus
        backoff. Raises ``error`` if it is not retriable, or if :meth:`retry_in` says stop."""
        retry_after = error.retry_after_s if error.retry_after_s is not None else default_s
        delay = self.retry_in(now, retry_after) if error.retriable else None
        if delay is None:
            raise error
        return delay


# server-sent events -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TaskEvent:
    """One status of a task, as its event stream sent it: ``id`` the status's rank (0 queued, 1 batched,
    2 running, 3 ended), ``task`` the task's JSON (as ``GET /v1/result/<id>`` answers it)."""

    id: int
    status: str
    task: Mapping[str, Any] = field(hash=False)

    @property
    def task_id(self) -> str:
        return str(self.task.get("task_id"))

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def output(self) -> str | None:
        output = self.task.get("output")
        return output if isinstance(output, str) else None


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    event: str
    data: str
    id: str | None


class EventDecoder:
    """Server-sent events from a stream's lines, after the WHATWG rules.

    By hand rather than with httpx-sse: the rules this API's streams need are these thirty lines, and
    the client then needs httpx alone.
    """

    def __init__(self) -> None:
        self.retry_s: float | None = None
        """The stream's reconnection time (its ``retry:`` field), once sent."""
        self._event = ""
        self._data: list[str] = []
        self._id: str | None = None

    @property
    def pending(self) -> bool:
        """Whether an event has data that no blank line has completed yet."""
        return bool(self._data)

    def restart(self) -> None:
        """A new connection: an event the last one cut off is dropped; ``retry_s`` stands."""
        self._event, self._data, self._id = "", [], None

    def line(self, line: str) -> ServerSentEvent | None:
        """Takes one line (without its end); returns the event a blank line completes."""
        if not line:
            if not self._data:
                self._event, self._id = "", None
                return None
            event = ServerSentEvent(self._event or "message", "\n".join(self._data), self._id)
            self._event, self._data, self._id = "", [], None
            return event
        if line.startswith(":"):  # a comment: the server's keep-alive ping
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id" and "\0" not in value:
            self._id = value
        elif name == "retry" and _ascii_digits(value):
            self.retry_s = int(value) / 1000
        return None


@dataclass
class Resume:
    """What a task's event streams delivered so far: the last event id, which a reconnection sends as
    ``Last-Event-ID`` so the server skips what was read, and whether the terminal event came.

    An event whose id is not above the last is dropped here too, so no status is yielded twice even
    by a server that does not resume."""

    last_id: int = -1
    ended: bool = False

    def headers(self) -> dict[str, str]:
        return {LAST_EVENT_ID_HEADER: str(self.last_id)} if self.last_id >= 0 else {}

    def take(self, event: ServerSentEvent) -> TaskEvent | None:
        """The task's event ``event`` is, or None for one already delivered; an ``error`` event raises
        its typed error (status None); data that is no JSON object is no gateway's event: a
        :class:`ServerError` ``invalid_answer``, not the caller's ``JSONDecodeError`` or ``AttributeError``."""
        try:
            doc = json.loads(event.data)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            raise ServerError(
                "invalid_answer",
                f"the event stream's {event.event!r} event is not the API's (its data is no JSON object; a "
                f"proxy's stream?): {event.data[:200]!r}",
            )
        if event.event == "error":
            detail = doc.get("error")
            raise _error(detail if isinstance(detail, dict) else {"code": "unknown"}, None)
        status = str(doc.get("status", event.event))
        rank = int(event.id) if event.id is not None and _ascii_digits(event.id) else _RANKS.get(status, self.last_id)
        if rank <= self.last_id:
            return None
        self.last_id = rank
        task_event = TaskEvent(rank, status, doc)
        self.ended = task_event.terminal
        return task_event


class _Follow:
    """One ``events`` call over all its connections, without I/O: the stream's text in; new events,
    each connection's headers and the wait before the next one out."""

    def __init__(self, max_retries: int, longest_wait_s: float) -> None:
        self._resume = Resume()
        self._decoder = EventDecoder()
        self._attempts = Attempts(math.inf, max_retries)
        self._longest_wait_s = longest_wait_s
        self._lines = _Lines()
        self._heard = False
        """Whether this connection's stream carried anything: the gateway's always opens with an event or a ping."""

    @property
    def ended(self) -> bool:
        return self._resume.ended

    def connect(self) -> dict[str, str]:
        """A new connection's headers (its ``Last-Event-ID``)."""
        self._decoder.restart()
        self._lines = _Lines()
        self._heard = False
        return self._resume.headers()

    def text(self, text: str) -> Iterator[TaskEvent]:
        """The events not yet delivered that ``text``, the stream's next piece, completes; none after the
        terminal one. Each is yielded as it is read: an ``error`` event after them raises only once they
        are delivered, since the reconnection resumes after them."""
        self._heard = self._heard or bool(text)
        for line in self._lines.feed(text):
            if self.ended:
                break
            if (event := self.line(line)) is not None:
                yield event

    def line(self, line: str) -> TaskEvent | None:
        """The event not yet delivered that ``line`` completes; delivering one starts the retries over."""
        sse = self._decoder.line(line)
        event = self._resume.take(sse) if sse is not None else None
        if event is not None:
            self._attempts.progressed()
        return event

    def reconnect_in(self, failure: BatchwireError | None, now: float) -> float:
        """The wait before reconnecting after ``failure`` (a refusal's Retry-After, else the stream's
        ``retry:``, else ``RECONNECT_S`` after a refused connection); raises ``failure`` if it is not retriable,
        the retries are spent, or its Retry-After is ``longest_wait_s`` or more (the stream's read timeout:
        no wait longer than a silence it allows).

        ``failure`` None: the server ended the stream before the task ended (it closes one after
        BATCHWIRE_SSE_MAX_S, and as it shuts down). That spends no retry, as a long-poll that answers a
        task still running spends none: the stream's ``retry:`` (else ``POLL_EVERY_S``) and a jitter. A
        stream that carried nothing at all, or that ends inside an event, is no gateway's (a proxy answering
        for it, or cutting its answer short): a failure, else it is asked again, cut at the same place, for ever."""
        if failure is None and not self._heard:
            failure = Unreachable("unreachable", "the event stream ended empty, before the task ended")
        if failure is None and (self._lines.pending or self._decoder.pending):
            failure = Unreachable("unreachable", "the event stream ended inside an event, before the task ended")
        if failure is None:
            self._attempts.progressed()
            pause = self._retry_s if self._retry_s is not None else POLL_EVERY_S
            return pause + self._attempts.jitter(BASE_BACKOFF_S)
        if failure.retry_after_s is not None and failure.retry_after_s >= self._longest_wait_s:
            raise failure
        return self._attempts.wait_after(
            failure, now, self._retry_s if self._retry_s is not None else _least_wait_s(failure)
        )

    @property
    def _retry_s(self) -> float | None:
        """The stream's ``retry:``, at most the longest wait this client takes from a server (a Retry-After
        that long is raised): a stream that says ``retry: 3600000`` does not park the caller for an hour."""
        retry_s = self._decoder.retry_s
        return None if retry_s is None else min(retry_s, self._longest_wait_s)


# shared by both clients ---------------------------------------------------------------------------
_LINE_END = re.compile(r"\r\n|\r|\n")


class _Lines:
    """An event stream's lines from its text as it comes. Only CR, LF and CRLF end a line: httpx's
    ``iter_lines`` splits as ``str.splitlines`` does, also at U+2028 and others, which a JSON string in
    an event's data may hold."""

    def __init__(self) -> None:
        self._rest = ""

    def feed(self, text: str) -> list[str]:
        text = self._rest + text
        held = "\r" if text.endswith("\r") else ""  # maybe the first half of a CRLF
        *lines, rest = _LINE_END.split(text[: len(text) - len(held)])
        self._rest = rest + held
        return lines

    @property
    def pending(self) -> bool:
        """Whether a line has begun that no line end has ended yet."""
        return bool(self._rest)


def _poll_params(attempts: Attempts, now: float) -> dict[str, float]:
    """A long-poll attempt's ``?wait=``: at most ``POLL_CHUNK_S``, and the time left now."""
    return {"wait": round(min(POLL_CHUNK_S, attempts.remaining_s(now)), 3)}


def _poll_pause(attempts: Attempts, polled: float, now: float) -> float:
    """How long to wait before the next poll of one that began at ``polled`` and answered a task still
    running: the rest of ``POLL_EVERY_S``, within the time left (0 after a poll the server held)."""
    return max(0.0, min(POLL_EVERY_S - (now - polled), attempts.remaining_s(now)))


def _submit_error(response: httpx.Response) -> BatchwireError:
    """A submit's error answer: a ``timeout_ms`` the server refuses is the caller's ``timeout``, which the
    server's message cannot name."""
    error = error_of(response)
    if error.code == "timeout_out_of_range":
        error.add_note("the client sends each call's timeout (seconds) as timeout_ms: pass a shorter timeout")
    return error


def _note_input(error: BaseException, index: int) -> None:
    """Names the input of ``infer_many`` whose call failed: the server's message does not say which of them."""
    if isinstance(error, BatchwireError):
        error.add_note(f"infer_many: inputs[{index}] failed")


def _headers(api_key: str | None) -> dict[str, str]:
    """The headers of every call. The key is stripped, as the server strips its own: one read from a file
    (a mounted secret) keeps its line end, which no header carries, and httpx's refusal of it would be
    retried and raised as an unreachable server. A key with another character no header carries is
    refused here, unsent, its position named (never the key)."""
    key = (api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")).strip()
    if (at := next((n for n, char in enumerate(key) if not "!" <= char <= "~"), None)) is not None:
        raise ValueError(
            f"the API key (api_key, else ${API_KEY_ENV}) has a space, a control or a non-ASCII character at "
            f"position {at}, which no header carries: give the key as the server's keys file lists it"
        )
    headers = {"User-Agent": "batchwire-client"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def _submit_body(input: str, model: str | None, priority: Priority | None) -> dict[str, Any]:
    """A submit's body; an input with a lone surrogate (text decoded with ``surrogateescape``) raises the
    error the server answers it with, unsent: httpx writes JSON as UTF-8, which cannot hold one, and its
    ``UnicodeEncodeError`` came from inside httpx."""
    if not input.isascii():
        try:
            input.encode()
        except UnicodeEncodeError as err:
            raise InvalidRequest(
                "invalid_json",
                f"input holds a lone surrogate (U+{ord(input[err.start]):04X}) at index {err.start}, which no "
                "UTF-8 text holds: nothing was sent; decode the text with errors='replace'",
            ) from err
    body: dict[str, Any] = {"input": input}
    if model is not None:
        body["model"] = model
    if priority is not None:
        body["priority"] = priority
    return body


def _result_path(task_id: str) -> str:
    return RESULT_PATH.format(task_id=quote(task_id, safe=""))


def _events_path(task_id: str) -> str:
    return EVENTS_PATH.format(task_id=quote(task_id, safe=""))


def _still_running(task_id: str, state: Mapping[str, Any], wait_s: float) -> DeadlineExceeded:
    return DeadlineExceeded(
        "deadline_exceeded", f"task {task_id} is still {state.get('status')} after {wait_s:g} s", task_id=task_id
    )


def _deadline_passed(err: Exception) -> DeadlineExceeded:
    return DeadlineExceeded("deadline_exceeded", f"no answer before the call's deadline (its timeout): {err!r}")


class _BodyBy(httpx.SyncByteStream):
    """An answer's body that gives up once ``give_up`` (``time.monotonic()``) passes before its end."""

    def __init__(self, body: httpx.SyncByteStream, give_up: float, request: httpx.Request) -> None:
        self._body = body
        self._give_up = give_up
        self._request = request

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._body:
            if time.monotonic() > self._give_up:
                raise httpx.ReadTimeout("the answer was still coming past the call's deadline", request=self._request)
            yield chunk

    def close(self) -> None:
        self._body.close()


def _read_by(response: httpx.Response, give_up: float) -> httpx.Response:
    """Reads a blocking attempt's answer, closed unread (its connection with it) if its body is still coming
    at ``give_up``: a server that sends a byte now and then, each within the read timeout, would hold
    the call for as long as it likes."""
    try:
        assert isinstance(response.stream, httpx.SyncByteStream)
        response.stream = _BodyBy(response.stream, give_up, response.request)
        response.read()
    except BaseException:
        response.close()
        raise
    return response


def _least_wait_s(error: BatchwireError) -> float | None:
    """The wait before retrying after ``error`` when it has no Retry-After: ``RECONNECT_S`` after a refused
    connection (nothing listens: the gateway is restarting) or a proxy's 502 (the same, behind it), else the
    backoff alone: a reset connection (a stale keep-alive one, encode/httpcore#1110) is retried at once."""
    if not isinstance(error, Unreachable):
        return None
    return RECONNECT_S if isinstance(error.__cause__, httpx.ConnectError) or error.code == "http_502" else None


def _unreachable(err: httpx.TransportError) -> Unreachable:
    error = Unreachable("unreachable", f"no connection to the server: {err!r}")
    error.__cause__ = err
    return error


def _no_more_events() -> ServerError:
    """A 204 ("no more events") to an event stream: the gateway sends it only to a resume whose
    ``Last-Event-ID`` was the terminal event's, which this client never makes (it stops there)."""
    return ServerError(
        "invalid_answer",
        "the event stream answered 204 (no more events) before the task's terminal event: no answer of the "
        "API's (a proxy's?)",
    )


def _undecodable(err: httpx.DecodingError) -> ServerError:
    """An answer whose body its ``Content-Encoding`` cannot decode (a proxy's corrupt gzip): no answer of the
    API's, as a proxy's page is not, and not httpx's own error."""
    error = ServerError("invalid_answer", f"the answer's body cannot be decoded (its Content-Encoding): {err!r}")
    error.__cause__ = err
    return error


class _ClientBase:
    """What both clients share besides their httpx client: each call's deadline and retries."""

    def __init__(self, timeout: float, max_retries: int) -> None:
        self.timeout = timeout
        self.max_retries = max_retries
        self._stream_timeout = httpx.Timeout(
            min(timeout, LONGEST_ATTEMPT_S), read=min(max(timeout, STREAM_READ_S), LONGEST_ATTEMPT_S)
        )

    def _attempts(self, timeout: float | None) -> Attempts:
        return Attempts(time.monotonic() + (self.timeout if timeout is None else timeout), self.max_retries)

    def _submit_attempts(self, timeout: float | None) -> Attempts:
        """A submit's attempts; one with no time (a ``timeout`` of 0 or less) is refused unsent, since the
        server would queue a task already past its deadline. A wait of 0 (``result``) is a plain read."""
        timeout = self.timeout if timeout is None else timeout
        if not timeout > 0:  # NaN too
            raise DeadlineExceeded(
                "deadline_exceeded",
                f"timeout is {timeout!r} s, no time for an answer: nothing was sent; give one above 0",
            )
        return self._attempts(timeout)


class Client(_ClientBase):
    """batchwire's HTTP API, blocking. Thread-safe: ``infer_many`` runs its calls in threads.

    ``api_key`` falls back to ``$BATCHWIRE_API_KEY``; ``timeout`` (seconds) is each call's deadline,
    retries included, unless the call gives its own (a submit's may not pass the server's
    BATCHWIRE_MAX_TIMEOUT_MS, 30 s by default); ``transport`` is handed to httpx (tests record or cut
    connections with it).
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(timeout, max_retries)
        self._http = httpx.Client(
            base_url=base_url, headers=_headers(api_key), timeout=timeout, limits=POOL_LIMITS, transport=transport
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def infer(
        self, input: str, *, model: str | None = None, timeout: float | None = None, priority: Priority | None = None
    ) -> str:
        """Runs ``input`` and returns its output (``POST /v1/inference``: the connection waits for it)."""
        attempts = self._submit_attempts(timeout)
        response = self._call("POST", INFERENCE_PATH, attempts, body=_submit_body(input, model, priority))
        return str(_answer(response, "output")["output"])

    def submit(
        self, input: str, *, model: str | None = None, timeout: float | None = None, priority: Priority | None = None
    ) -> Task:
        """Queues ``input`` (``POST /v1/tasks``); ``timeout`` is also how long the task may wait for its answer."""
        attempts = self._submit_attempts(timeout)
        response = self._call("POST", TASKS_PATH, attempts, body=_submit_body(input, model, priority))
        return Task(str(_answer(response, "task_id")["task_id"]), self)

    def task(self, task_id: str) -> Task:
        """The task ``task_id`` names, e.g. one a :class:`DeadlineExceeded` carries."""
        return Task(task_id, self)

    def result(self, task_id: str, *, wait: float | None = None) -> str:
        """The task's output once it ends, long-polling up to ``wait`` seconds (default: the client's
        ``timeout``); raises :class:`TaskFailed` if it ends without one, :class:`DeadlineExceeded` if
        it has not ended by then."""
        wait_s = self.timeout if wait is None else wait
        attempts = self._attempts(wait_s)
        while True:
            polled = time.monotonic()
            state = _answer(self._call("GET", _result_path(task_id), attempts, poll=True), "status")
            if state.get("status") in TERMINAL:
                return output_of(state)
            if attempts.remaining_s(time.monotonic()) <= 0:
                raise _still_running(task_id, state, wait_s)
            attempts.progressed()  # the poll got through: a refusal later has its own retries
            time.sleep(_poll_pause(attempts, polled, time.monotonic()))

    def events(self, task_id: str) -> Iterator[TaskEvent]:
        """The task's statuses as they change, each once, the terminal one last: a task that fails,
        expires or is cancelled ends the events, it raises nothing. A connection that drops, or a
        stream the server ends first (after BATCHWIRE_SSE_MAX_S), is resumed after the last event read;
        a refusal whose Retry-After is the stream's read timeout (the client's ``timeout``, at least
        ``STREAM_READ_S``) or longer is raised."""
        follow = _Follow(self.max_retries, max(self.timeout, STREAM_READ_S))
        while not follow.ended:
            try:
                with self._http.stream(
                    "GET", _events_path(task_id), headers=follow.connect(), timeout=self._stream_timeout
                ) as response:
                    if response.status_code == 204:
                        raise _no_more_events()
                    if not response.is_success:
                        response.read()
                        raise error_of(response)
                    if not _is_event_stream(response):
                        response.read()
                        raise _not_events(response)
                    for text in response.iter_text():
                        yield from follow.text(text)
                        if follow.ended:
                            return
                failure: BatchwireError | None = None  # the server ended the stream before the task
            except BatchwireError as err:
                failure = err
            except httpx.TransportError as err:  # a reset, a read past the timeout, a proxy that closes
                failure = _unreachable(err)
            except httpx.DecodingError as err:
                failure = _undecodable(err)
            time.sleep(follow.reconnect_in(failure, time.monotonic()))

    def cancel(self, task_id: str) -> None:
        """Cancels a queued or batched task (``DELETE``); :class:`NotCancellable` if it runs or ended."""
        self._call("DELETE", _result_path(task_id), self._attempts(None))

    def infer_many(
        self, inputs: Iterable[str], *, model: str | None = None, concurrency: int = DEFAULT_CONCURRENCY
    ) -> list[str]:
        """Each input's output, in input order, with at most ``concurrency`` calls in flight (threads),
        so the server's queue holds at most that many of them. The first failing input's error is
        raised, with a note naming its index (``inputs[i]``), and the calls not yet started are dropped.
        An interrupt (Ctrl-C) is raised at once."""
        if concurrency < 1:
            raise ValueError(f"concurrency is {concurrency}; it must be at least 1")
        items = list(inputs)
        if not items:
            return []
        failed = threading.Event()

        def one(index: int, text: str) -> str | None:
            if failed.is_set():
                return None  # not started when another call failed: dropped
            try:
                return self.infer(text, model=model)
            except BaseException as err:
                failed.set()
                _note_input(err, index)
                raise

        pool = ThreadPoolExecutor(max_workers=min(concurrency, len(items)), thread_name_prefix="batchwire")
        futures = [pool.submit(one, index, text) for index, text in enumerate(items)]
        try:
            wait_for(futures)
        except BaseException:  # the caller interrupted: nothing more starts, and nothing waits for the calls
            failed.set()  # in flight, which end on their own (an answer, or the client's timeout)
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        for future in futures:
            if (error := future.exception()) is not None:
                raise error
        return [str(future.result()) for future in futures]

    def _call(
        self,
        method: str,
        path: str,
        attempts: Attempts,
        *,
        body: dict[str, Any] | None = None,
        poll: bool = False,
    ) -> httpx.Response:
        """One logical call: attempts until an answer that is not a refusal, or the deadline. A submit
        (``body``) carries one Idempotency-Key throughout, and the time left as its ``timeout_ms``; a
        long-poll (``poll``) asks each attempt to wait at most ``POLL_CHUNK_S`` and the time left."""
        headers = {IDEMPOTENCY_HEADER: uuid.uuid4().hex} if body is not None else {}
        while True:
            now = time.monotonic()
            sent = {**body, "timeout_ms": attempts.timeout_ms(now)} if body is not None else None
            params = _poll_params(attempts, now) if poll else None
            within_s = attempts.answer_within_s(now)
            request = self._http.build_request(
                method, path, json=sent, params=params, headers=headers, timeout=within_s
            )
            try:
                response = _read_by(self._http.send(request, stream=True), now + within_s)
            except httpx.TimeoutException as err:
                raise _deadline_passed(err) from err
            except httpx.DecodingError as err:
                raise _undecodable(err) from err
            except httpx.TransportError as err:
                error: BatchwireError = _unreachable(err)
            else:
                if response.is_success:
                    return response
                error = error_of(response) if body is None else _submit_error(response)
            time.sleep(attempts.wait_after(error, time.monotonic(), _least_wait_s(error)))


class AsyncClient(_ClientBase):
    """batchwire's HTTP API, awaited: :class:`Client`'s methods, as coroutines (``events`` is an async
    iterator)."""

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(timeout, max_retries)
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=_headers(api_key), timeout=timeout, limits=POOL_LIMITS, transport=transport
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def infer(
        self,
        input: str,
        *,
        model: str | None = None,
        # Not asyncio.timeout's job: it is also the deadline the server holds the request to (``timeout_ms``).
        timeout: float | None = None,  # noqa: ASYNC109
        priority: Priority | None = None,
    ) -> str:
        """Runs ``input`` and returns its output (``POST /v1/inference``: the connection waits for it)."""
        attempts = self._submit_attempts(timeout)
        response = await self._call("POST", INFERENCE_PATH, attempts, body=_submit_body(input, model, priority))
        return str(_answer(response, "output")["output"])

    async def submit(
        self,
        input: str,
        *,
        model: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (as infer's)
        priority: Priority | None = None,
    ) -> AsyncTask:
        """Queues ``input`` (``POST /v1/tasks``); ``timeout`` is also how long the task may wait for its answer."""
        attempts = self._submit_attempts(timeout)
        response = await self._call("POST", TASKS_PATH, attempts, body=_submit_body(input, model, priority))
        return AsyncTask(str(_answer(response, "task_id")["task_id"]), self)

    def task(self, task_id: str) -> AsyncTask:
        """The task ``task_id`` names, e.g. one a :class:`DeadlineExceeded` carries."""
        return AsyncTask(task_id, self)

    async def result(self, task_id: str, *, wait: float | None = None) -> str:
        """:meth:`Client.result`, awaited."""
        wait_s = self.timeout if wait is None else wait
        attempts = self._attempts(wait_s)
        while True:
            polled = time.monotonic()
            state = _answer(await self._call("GET", _result_path(task_id), attempts, poll=True), "status")
            if state.get("status") in TERMINAL:
                return output_of(state)
            if attempts.remaining_s(time.monotonic()) <= 0:
                raise _still_running(task_id, state, wait_s)
            attempts.progressed()  # the poll got through: a refusal later has its own retries
            await asyncio.sleep(_poll_pause(attempts, polled, time.monotonic()))

    async def events(self, task_id: str) -> AsyncIterator[TaskEvent]:
        """:meth:`Client.events`, as an async iterator. Left before its end, close it
        (``async with contextlib.aclosing(client.events(task_id)) as events:``): an async generator
        left open keeps its connection until the garbage collector finds it."""
        follow = _Follow(self.max_retries, max(self.timeout, STREAM_READ_S))
        while not follow.ended:
            try:
                async with self._http.stream(
                    "GET", _events_path(task_id), headers=follow.connect(), timeout=self._stream_timeout
                ) as response:
                    if response.status_code == 204:
                        raise _no_more_events()
                    if not response.is_success:
                        await response.aread()
                        raise error_of(response)
                    if not _is_event_stream(response):
                        await response.aread()
                        raise _not_events(response)
                    async for text in response.aiter_text():
                        for event in follow.text(text):
                            yield event
                        if follow.ended:
                            return
                failure: BatchwireError | None = None
            except BatchwireError as err:
                failure = err
            except httpx.TransportError as err:  # a reset, a read past the timeout, a proxy that closes
                failure = _unreachable(err)
            except httpx.DecodingError as err:
                failure = _undecodable(err)
            await asyncio.sleep(follow.reconnect_in(failure, time.monotonic()))

    async def cancel(self, task_id: str) -> None:
        """:meth:`Client.cancel`, awaited."""
        await self._call("DELETE", _result_path(task_id), self._attempts(None))

    async def infer_many(
        self, inputs: Iterable[str], *, model: str | None = None, concurrency: int = DEFAULT_CONCURRENCY
    ) -> list[str]:
        """Each input's output, in input order, with at most ``concurrency`` calls in flight (a
        semaphore), so the server's queue holds at most that many of them. The first error raised
        is raised here, with a note naming its input's index, and the other calls are cancelled."""
        if concurrency < 1:
            raise ValueError(f"concurrency is {concurrency}; it must be at least 1")
        slots = asyncio.Semaphore(concurrency)

        async def one(index: int, text: str) -> str:
            async with slots:
                try:
                    return await self.infer(text, model=model)
                except BatchwireError as err:
                    _note_input(err, index)
                    raise

        try:
            async with asyncio.TaskGroup() as group:
                calls = [group.create_task(one(index, text)) for index, text in enumerate(inputs)]
        except ExceptionGroup as failed:
            error = failed.exceptions[0]
            raise error from error.__cause__  # not the group: an Unreachable's cause is its last connection's failure
        return [call.result() for call in calls]

    async def _call(
        self,
        method: str,
        path: str,
        attempts: Attempts,
        *,
        body: dict[str, Any] | None = None,
        poll: bool = False,
    ) -> httpx.Response:
        """:meth:`Client._call`, awaited."""
        headers = {IDEMPOTENCY_HEADER: uuid.uuid4().hex} if body is not None else {}
        while True:
            now = time.monotonic()
            sent = {**body, "timeout_ms": attempts.timeout_ms(now)} if body is not None else None
            params = _poll_params(attempts, now) if poll else None
            within_s = attempts.answer_within_s(now)
            try:
                async with asyncio.timeout(within_s):  # httpx's timeout bounds each read, not the answer
                    response = await self._http.request(
                        method, path, json=sent, params=params, headers=headers, timeout=within_s
                    )
            except (httpx.TimeoutException, TimeoutError) as err:
                raise _deadline_passed(err) from err
            except httpx.DecodingError as err:
                raise _undecodable(err) from err
            except httpx.TransportError as err:
                error: BatchwireError = _unreachable(err)
            else:
                if response.is_success:
                    return response
                error = error_of(response) if body is None else _submit_error(response)
            await asyncio.sleep(attempts.wait_after(error, time.monotonic(), _least_wait_s(error)))


@dataclass(frozen=True, slots=True)
class Task:
    """A queued task of a :class:`Client`: follow it by its ``id``."""

    id: str
    client: Client = field(repr=False)

    def result(self, *, wait: float | None = None) -> str:
        """:meth:`Client.result` of this task."""
        return self.client.result(self.id, wait=wait)

    def events(self) -> Iterator[TaskEvent]:
        """:meth:`Client.events` of this task."""
        return self.client.events(self.id)

    def cancel(self) -> None:
        """:meth:`Client.cancel` of this task."""
        self.client.cancel(self.id)


@dataclass(frozen=True, slots=True)
class AsyncTask:
    """A queued task of an :class:`AsyncClient`: follow it by its ``id``."""

    id: str
    client: AsyncClient = field(repr=False)

    async def result(self, *, wait: float | None = None) -> str:
        """:meth:`AsyncClient.result` of this task."""
        return await self.client.result(self.id, wait=wait)

    def events(self) -> AsyncIterator[TaskEvent]:
        """:meth:`AsyncClient.events` of this task."""
        return self.client.events(self.id)

    async def cancel(self) -> None:
        """:meth:`AsyncClient.cancel` of this task."""
        await self.client.cancel(self.id)
