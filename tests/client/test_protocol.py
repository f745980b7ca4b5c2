"""The client's decisions without sockets: retry delays, error types, and reading and resuming event streams.

Event streams are fed the very bytes the gateway writes (``gateway.edge.events``), and error answers
are built from the gateway's own error table, so a change on either side shows here first.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import pickle
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import pytest

from batchwire import client as client_module
from batchwire.client import (
    BASE_BACKOFF_S,
    MAX_BACKOFF_S,
    POLL_EVERY_S,
    STREAM_READ_S,
    AsyncClient,
    Attempts,
    BatchwireError,
    Client,
    DeadlineExceeded,
    EventDecoder,
    InvalidRequest,
    NotCancellable,
    NotFound,
    Overloaded,
    Resume,
    ServerError,
    ServerSentEvent,
    TaskEvent,
    TaskFailed,
    Unauthorized,
    Unreachable,
    _Lines,
    error_of,
    output_of,
    retry_after_s,
)
from gateway.edge.events import PING, RETRY, error_event, state_event
from gateway.errors import ERROR_TABLE, GatewayError, error_body
from schemas.records import TaskState, TaskStatus


def highest(cap_s: float) -> float:
    """The jitter's top: the longest delay the backoff allows."""
    return cap_s


# retries ---------------------------------------------------------------------------------------------
def test_delays_double_up_to_the_cap_and_stop_after_max_retries() -> None:
    attempts = Attempts(deadline=math.inf, max_retries=8, jitter=highest)
    delays = [attempts.retry_in(0.0) for _ in range(9)]
    expected = [min(MAX_BACKOFF_S, BASE_BACKOFF_S * 2**n) for n in range(8)]
    assert delays == [*expected, None], delays


def test_a_caller_that_never_gives_up_waits_the_cap_after_a_thousand_retries() -> None:
    """A watcher with ``max_retries`` in the billions (an endless ``events``): 2**1024 retries' backoff
    is past a float, and raised OverflowError."""
    attempts = Attempts(deadline=math.inf, max_retries=10**9, jitter=highest)
    delays = [attempts.retry_in(0.0) for _ in range(1100)]
    assert delays[-1] == MAX_BACKOFF_S, delays[-3:]


def test_jitter_spreads_each_delay_below_its_cap() -> None:
    attempts = Attempts(deadline=math.inf, max_retries=200)
    delays = [attempts.retry_in(0.0) for _ in range(200)]
    assert all(d is not None and 0 <= d <= MAX_BACKOFF_S for d in delays), delays
    assert len(set(delays)) > 100, "full jitter: callers refused together come back apart"


def test_a_retry_waits_at_least_retry_after() -> None:
    attempts = Attempts(deadline=math.inf, max_retries=3)
    for retry in range(3):
        delay = attempts.retry_in(0.0, retry_after=2.0)
        assert delay is not None and 2.0 <= delay <= 2.0 + BASE_BACKOFF_S * 2**retry, delay


def test_no_retry_starts_past_the_deadline() -> None:
    attempts = Attempts(deadline=10.0, max_retries=5, jitter=highest)
    assert attempts.retry_in(now=8.5, retry_after=1.0) == pytest.approx(1.1)
    assert attempts.retry_in(now=9.5, retry_after=1.0) is None, "1 s of Retry-After does not fit in 0.5 s"
    assert attempts.retries == 1, "a refused retry is not counted"


def test_the_server_gets_the_time_left_as_its_deadline() -> None:
    attempts = Attempts(deadline=30.0, max_retries=0)
    assert attempts.timeout_ms(0.0) == 30_000
    assert attempts.timeout_ms(29.9991) == 1
    assert attempts.timeout_ms(31.0) == 1, "never 0, which the server refuses"


def test_progress_starts_the_retries_over() -> None:
    attempts = Attempts(deadline=math.inf, max_retries=1, jitter=highest)
    assert attempts.retry_in(0.0) is not None and attempts.retry_in(0.0) is None
    attempts.progressed()
    assert attempts.retry_in(0.0) == BASE_BACKOFF_S


def test_retry_after_reads_seconds_and_http_dates() -> None:
    assert retry_after_s("3") == 3.0
    assert retry_after_s(None) is None and retry_after_s("soon") is None
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=120), usegmt=True)
    assert 110 < (retry_after_s(later) or 0) <= 120


def test_retry_after_of_other_digits_is_unreadable_not_an_error() -> None:
    """The header's seconds are ASCII digits; "²" is a digit to ``str.isdigit`` and no number to ``float``."""
    for value in ("²", "³⁵", "٣", "3.5", "-1"):
        assert retry_after_s(value) is None, f"{value!r} read as {retry_after_s(value)}"
    refused = [(b"Retry-After", "²".encode("latin-1"))]
    keys: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["Idempotency-Key"])
        if len(keys) == 1:
            return httpx.Response(503, json={"error": {"code": "overloaded", "message": "full"}}, headers=refused)
        return httpx.Response(200, json={"output": "olleh"})

    with Client("http://gw", transport=httpx.MockTransport(handler)) as client:
        assert client.infer("hello") == "olleh", "the refusal is retried after the backoff alone"
    assert len(keys) == 2, keys


def test_retry_after_dated_in_utc_without_naming_a_zone_is_read_as_utc(monkeypatch: pytest.MonkeyPatch) -> None:
    """A date whose zone is "-0000" (RFC 5322: UTC, the sender's own zone unknown) is UTC whatever the
    caller's local zone; it was read as local time."""
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        later = (datetime.now(UTC) + timedelta(seconds=120)).strftime("%a, %d %b %Y %H:%M:%S -0000")
        assert 110 < (retry_after_s(later) or 0) <= 120, f"{later!r} read as {retry_after_s(later)}"
    finally:
        monkeypatch.undo()
        time.tzset()


# errors ----------------------------------------------------------------------------------------------
EXPECTED_TYPE: dict[int, type[BatchwireError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: Unauthorized,
    404: NotFound,
    405: InvalidRequest,
    408: InvalidRequest,
    409: NotCancellable,
    413: InvalidRequest,
    415: InvalidRequest,
    422: InvalidRequest,
    429: Overloaded,
    431: InvalidRequest,
    499: InvalidRequest,
    500: ServerError,
    502: TaskFailed,
    503: Overloaded,
    504: DeadlineExceeded,
}
EXCEPTIONS = {"task_cancelled": TaskFailed, "priority_above_ceiling": InvalidRequest}


def answer(status: int, doc: Any = None, headers: dict[str, str] | None = None, text: str = "") -> httpx.Response:
    if doc is not None:
        return httpx.Response(status, json=doc, headers=headers)
    return httpx.Response(status, text=text, headers=headers)


@pytest.mark.parametrize("code", sorted(ERROR_TABLE))
def test_every_error_code_of_the_gateway_has_its_type(code: str) -> None:
    status = ERROR_TABLE[code][0]
    error = error_of(answer(status, error_body(code, "what to change", "t1")))
    expected = EXCEPTIONS.get(code) or EXPECTED_TYPE.get(status)
    assert expected is not None, f"{code} answers {status}, new to the client: map it in batchwire.client and here"
    assert type(error) is expected, f"{code} ({status}) became {type(error).__name__}, expected {expected.__name__}"
    assert (error.code, error.message, error.status, error.task_id) == (code, "what to change", status, "t1")


def test_what_the_gateway_retries_is_what_the_client_retries() -> None:
    retriable = {cls.code for cls in _subclasses(GatewayError) if cls.retriable and cls.code in ERROR_TABLE}
    assert retriable, "no retriable gateway error found"
    for code in sorted(ERROR_TABLE):
        error = error_of(answer(ERROR_TABLE[code][0], error_body(code, "m")))
        assert error.retriable == (code in retriable or ERROR_TABLE[code][0] == 503), f"{code}: {type(error)}"


def _subclasses(cls: type[GatewayError]) -> set[type[GatewayError]]:
    found = set(cls.__subclasses__())
    return found.union(*(_subclasses(sub) for sub in found))


def test_a_failed_tasks_own_code_is_a_task_failure_and_retry_after_is_kept() -> None:
    failed = error_of(answer(502, error_body("backend_error", "the model raised", "t1")))
    assert isinstance(failed, TaskFailed) and failed.code == "backend_error" and failed.task_status == "failed"
    refused = error_of(answer(503, error_body("overloaded", "full"), {"Retry-After": "7"}))
    assert isinstance(refused, Overloaded) and refused.retry_after_s == 7.0


def test_an_answer_without_the_error_body_is_typed_by_its_status() -> None:
    proxy = error_of(answer(503, text="<html>upstream down</html>"))
    assert isinstance(proxy, Overloaded) and proxy.code == "http_503" and "upstream down" in proxy.message
    odd = error_of(answer(500, {"detail": "not ours"}))
    assert isinstance(odd, ServerError) and odd.code == "http_500"


@pytest.mark.parametrize("status", [301, 307, 308])
def test_a_redirect_is_not_followed_and_names_where_it_points(status: int) -> None:
    """A proxy redirecting http to https: the client follows no redirect (a POST would lose its body or
    be sent twice), so the error says where the gateway answers instead of quoting the proxy's page."""
    moved = error_of(answer(status, text="<html>Moved</html>", headers={"Location": "https://gw.example/"}))
    assert type(moved) is ServerError and moved.code == f"http_{status}", f"{moved!r}"
    assert "https://gw.example/" in moved.message and "base_url" in moved.message, moved.message
    assert not moved.retriable


@pytest.mark.parametrize(("status", "page"), [(502, "502 Bad Gateway"), (504, "504 Gateway Time-out")])
def test_a_proxys_502_or_504_is_no_failed_task_or_deadline_but_an_unreachable_gateway_and_is_retried(
    status: int, page: str
) -> None:
    """Only the gateway's 502 or 504 (with its error body) says a task failed or its deadline passed; a
    proxy's says the gateway did not answer it (restarting, or slower than the proxy's own timeout, with the
    call's deadline still ahead), which a retry under the same Idempotency-Key may get past."""
    proxy = error_of(answer(status, text=f"<html><h1>{page}</h1></html>"))
    assert type(proxy) is Unreachable and proxy.code == f"http_{status}" and proxy.retriable, f"{proxy!r}"
    keys: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["Idempotency-Key"])
        if len(keys) == 1:
            return httpx.Response(status, text=f"<html><h1>{page}</h1></html>")
        return httpx.Response(200, json={"output": "olleh"})

    with Client("http://gw", transport=httpx.MockTransport(handler)) as client:
        assert client.infer("hello") == "olleh"
    assert len(keys) == 2 and keys[0] == keys[1], "retried once, under one key"


def test_a_terminal_state_is_its_output_or_a_task_failure() -> None:
    assert output_of({"task_id": "t", "status": "completed", "output": "olleh"}) == "olleh"
    failed = {"task_id": "t", "status": "failed", "error": {"code": "backend_error", "message": "boom"}}
    with pytest.raises(TaskFailed) as raised:
        output_of(failed)
    assert (raised.value.code, raised.value.task_status, raised.value.task_id) == ("backend_error", "failed", "t")
    with pytest.raises(TaskFailed) as cancelled:
        output_of({"task_id": "t", "status": "cancelled"})
    assert (cancelled.value.code, cancelled.value.task_status) == ("cancelled", "cancelled")


# event streams ---------------------------------------------------------------------------------------
def state(status: TaskStatus, **extra: Any) -> TaskState:
    return TaskState("t1", status, "sim", 1, 1, **extra)


def decode(stream: bytes) -> tuple[list[ServerSentEvent], EventDecoder]:
    decoder = EventDecoder()
    events = [e for line in stream.decode().splitlines() if (e := decoder.line(line)) is not None]
    return events, decoder


def test_the_gateways_stream_decodes_to_its_events_and_retry() -> None:
    stream = (
        RETRY
        + state_event(state(TaskStatus.QUEUED))
        + PING
        + state_event(state(TaskStatus.RUNNING))
        + state_event(state(TaskStatus.COMPLETED, output="olleh"))
    )
    events, decoder = decode(stream)
    assert [(e.event, e.id) for e in events] == [("queued", "0"), ("running", "2"), ("completed", "3")], events
    assert decoder.retry_s == 1.0


def test_multi_line_data_is_joined_and_an_event_without_data_is_dropped() -> None:
    events, _ = decode(b"event: a\ndata: one\ndata: two\nid: 5\n\nevent: empty\n\n: ping\n\ndata: x\n\n")
    assert events == [ServerSentEvent("a", "one\ntwo", "5"), ServerSentEvent("message", "x", None)], events


def test_an_event_cut_off_by_a_dropped_connection_is_not_delivered() -> None:
    decoder = EventDecoder()
    for line in ["retry: 1000", "event: queued", 'data: {"status": "queued"}']:
        assert decoder.line(line) is None
    decoder.restart()
    assert decoder.line("") is None, "the half event died with its connection"
    assert decoder.retry_s == 1.0, "the reconnection time stands"


def test_resume_sends_the_last_id_and_drops_what_was_delivered() -> None:
    resume = Resume()
    assert resume.headers() == {}
    events, _ = decode(state_event(state(TaskStatus.QUEUED)) + state_event(state(TaskStatus.RUNNING)))
    taken = [resume.take(e) for e in events]
    assert [(t.id, t.status) for t in taken if t is not None] == [(0, "queued"), (2, "running")]
    assert resume.headers() == {"Last-Event-ID": "2"} and not resume.ended
    again, _ = decode(state_event(state(TaskStatus.RUNNING)) + state_event(state(TaskStatus.FAILED)))
    assert resume.take(again[0]) is None, "a status delivered before is not delivered again"
    end = resume.take(again[1])
    assert end == TaskEvent(3, "failed", end.task if end else {}) and resume.ended, end


def test_a_retry_or_id_of_other_digits_is_unreadable_not_an_error() -> None:
    """As a Retry-After's: "²" is a digit to ``str.isdigit`` and no number to ``int``."""
    decoder = EventDecoder()
    assert decoder.line("retry: ²") is None and decoder.retry_s is None, decoder.retry_s
    taken = Resume().take(ServerSentEvent("running", '{"status": "running"}', "²"))
    assert taken is not None and taken.id == TaskStatus.RUNNING.rank, f"an unreadable id is the status's rank: {taken}"
    huge = "9" * 5000  # past 4,300 digits Python's int raises ValueError
    assert decoder.line(f"retry: {huge}") is None and decoder.retry_s is None, "no delay a server sends"
    taken = Resume().take(ServerSentEvent("running", '{"status": "running"}', huge))
    assert taken is not None and taken.id == TaskStatus.RUNNING.rank, taken


def test_a_streams_retry_field_waits_no_longer_than_a_retry_after_would() -> None:
    """A Retry-After as long as the stream's longest wait is raised; a ``retry:`` of an hour is cut to it."""
    follow = client_module._Follow(3, 2.0)
    list(follow.text("retry: 3600000\n\n" + state_event(state(TaskStatus.QUEUED)).decode()))
    assert follow.reconnect_in(None, time.monotonic()) <= 2.0 + client_module.BASE_BACKOFF_S


def test_an_error_event_raises_its_typed_error() -> None:
    events, _ = decode(error_event("unavailable", "the task store is down"))
    with pytest.raises(Overloaded) as raised:
        Resume().take(events[0])
    assert raised.value.retriable and raised.value.status is None and raised.value.code == "unavailable"


@pytest.mark.parametrize(
    ("event", "data"),
    [("queued", "not json"), ("message", "[1, 2]"), ("message", '"queued"'), ("error", "the store is down")],
)
def test_an_event_whose_data_is_no_json_object_is_a_server_error(event: str, data: str) -> None:
    """A proxy's or a broken server's stream: the client's typed error, never ``JSONDecodeError`` or
    ``AttributeError`` out of ``events``."""
    with pytest.raises(ServerError) as raised:
        Resume().take(ServerSentEvent(event, data, "0"))
    assert raised.value.code == "invalid_answer" and data in raised.value.message, raised.value


async def test_an_event_stream_with_garbage_data_raises_a_server_error_once() -> None:
    opened: list[str] = []

    def garbage(request: httpx.Request) -> httpx.Response:
        opened.append(request.url.path)
        return httpx.Response(200, content=b"id: 0\ndata: <html>\n\n", headers={"content-type": "text/event-stream"})

    with Client("http://gw", transport=httpx.MockTransport(garbage)) as client, pytest.raises(ServerError) as raised:
        list(client.events("t1"))
    assert raised.value.code == "invalid_answer", raised.value
    async with AsyncClient("http://gw", transport=httpx.MockTransport(garbage)) as aclient:
        with pytest.raises(ServerError) as araised:
            _ = [event async for event in aclient.events("t1")]
    assert araised.value.code == "invalid_answer", araised.value
    assert len(opened) == 2, f"each client asked once, not again: {opened}"


# over httpx's mock transport: what goes on the wire and what comes back -----------------------------

LINE_SEPARATED = "line one\u2028line two\u0085three"


def _stream_with_separators(request: httpx.Request) -> httpx.Response:
    """The gateway writes event data with ``ensure_ascii=False``: U+2028 and U+0085 travel as they are."""
    queued = TaskState("t1", TaskStatus.QUEUED, "sim", 1, 1)
    done = TaskState("t1", TaskStatus.COMPLETED, "sim", 1, 1, output=LINE_SEPARATED, batch_size=1)
    body = RETRY + state_event(queued) + state_event(done)
    return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})


async def test_only_cr_and_lf_end_an_events_line_not_the_separators_a_json_string_holds() -> None:
    with Client("http://gw", transport=httpx.MockTransport(_stream_with_separators), max_retries=0) as client:
        events = list(client.events("t1"))
    async with AsyncClient(
        "http://gw", transport=httpx.MockTransport(_stream_with_separators), max_retries=0
    ) as aclient:
        aevents = [event async for event in aclient.events("t1")]
    for got in (events, aevents):
        assert [(event.status, event.output) for event in got] == [("queued", None), ("completed", LINE_SEPARATED)]


def _store_fails_after_queued(seen: list[str | None]) -> httpx.MockTransport:
    """The first stream's one chunk holds its queued event and the ``error`` event of a store that
    failed next (a client reading late gets both in one read); the reconnection's, what came after."""

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Last-Event-ID"))
        if len(seen) == 1:
            body = state_event(state(TaskStatus.QUEUED)) + error_event("unavailable", "the task store is down")
        else:
            after = int(seen[-1] or -1)
            later = [state(TaskStatus.QUEUED), state(TaskStatus.RUNNING), state(TaskStatus.COMPLETED, output="x")]
            body = b"".join(state_event(s) for s in later if s.status.rank > after)
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


async def test_an_event_read_with_an_error_event_is_delivered_before_the_reconnection() -> None:
    seen: list[str | None] = []
    with Client("http://gw", transport=_store_fails_after_queued(seen)) as client:
        events = [event.status for event in client.events("t1")]
    aseen: list[str | None] = []
    async with AsyncClient("http://gw", transport=_store_fails_after_queued(aseen)) as aclient:
        aevents = [event.status async for event in aclient.events("t1")]
    for got, streams in ((events, seen), (aevents, aseen)):
        assert streams == [None, "0"], f"one reconnection, after the queued event: {streams}"
        assert got == ["queued", "running", "completed"], f"an event resumed after was never delivered: {got}"


def _ended_at_its_longest_life(opened: list[str | None], quiet_streams: int) -> httpx.MockTransport:
    """A task queued through ``quiet_streams`` streams that the server ends with nothing new (it closes a
    stream after BATCHWIRE_SSE_MAX_S), then completed."""

    def handler(request: httpx.Request) -> httpx.Response:
        opened.append(request.headers.get("last-event-id"))
        if len(opened) == 1:
            body = RETRY.replace(b"1000", b"10") + state_event(state(TaskStatus.QUEUED))
        elif len(opened) <= quiet_streams:
            body = PING
        else:
            body = state_event(state(TaskStatus.COMPLETED, output="x"))
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


async def test_a_stream_the_server_ends_before_the_task_is_resumed_without_spending_a_retry() -> None:
    """A long-poll that answers a task still running spends no retry; nor does a stream the server ended
    at its longest life: a task queued longer than max_retries such streams was given up as unreachable."""
    opened: list[str | None] = []
    with Client("http://gw", transport=_ended_at_its_longest_life(opened, 4), max_retries=1) as client:
        events = [event.status for event in client.events("t1")]
    aopened: list[str | None] = []
    async with AsyncClient("http://gw", transport=_ended_at_its_longest_life(aopened, 4), max_retries=1) as aclient:
        aevents = [event.status async for event in aclient.events("t1")]
    for got, streams in ((events, opened), (aevents, aopened)):
        assert got == ["queued", "completed"], f"the task's end was not delivered: {got} over streams {streams}"
        assert streams == [None, "0", "0", "0", "0"], f"each stream resumes after the queued event: {streams}"


def _empty_streams(opened: list[str | None]) -> httpx.MockTransport:
    """A proxy answering for the gateway with an empty event stream, every time."""

    def handler(request: httpx.Request) -> httpx.Response:
        opened.append(request.headers.get("last-event-id"))
        return httpx.Response(200, content=b"", headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


async def test_streams_that_end_empty_spend_the_retries_and_raise_unreachable() -> None:
    """Every stream of the gateway's carries something (an event, or a ping at once), so an empty one is a
    proxy's answer, a failed connection: it spends a retry, where a stream the gateway ended spends none."""
    opened: list[str | None] = []
    with (
        Client("http://gw", transport=_empty_streams(opened), max_retries=1) as client,
        pytest.raises(Unreachable, match="ended empty"),
    ):
        list(client.events("t1"))
    aopened: list[str | None] = []
    async with AsyncClient("http://gw", transport=_empty_streams(aopened), max_retries=1) as aclient:
        with pytest.raises(Unreachable, match="ended empty"):
            _ = [event async for event in aclient.events("t1")]
    assert len(opened) == len(aopened) == 2, f"one try and one retry each: {opened}, {aopened}"


def _streams_cut_inside_an_event(opened: list[str | None], keep: int) -> httpx.MockTransport:
    """A proxy that ends each event stream cleanly after the queued event and the first ``keep`` bytes of the
    running one (a limit on an answer's size): the gateway ends its streams between events."""
    queued = state_event(state(TaskStatus.QUEUED))

    def handler(request: httpx.Request) -> httpx.Response:
        opened.append(request.headers.get("last-event-id"))
        if len(opened) > 10:  # an end to the loop this guards against
            return httpx.Response(500, json={"error": {"code": "internal_error", "message": "asked too often"}})
        body = queued + state_event(state(TaskStatus.RUNNING))[:keep]
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


@pytest.mark.parametrize("cut", ["inside a line", "before the blank line"])
async def test_streams_that_end_inside_an_event_spend_the_retries_and_raise_unreachable(cut: str) -> None:
    """Taken for a stream the gateway ended, such a stream spent no retry: ``events`` asked again for ever,
    cut at the same place each time."""
    running = state_event(state(TaskStatus.RUNNING))
    keep = len(running) // 2 if cut == "inside a line" else len(running) - 2
    opened: list[str | None] = []
    with (
        Client("http://gw", transport=_streams_cut_inside_an_event(opened, keep), max_retries=1) as client,
        pytest.raises(Unreachable, match="inside an event"),
    ):
        list(client.events("t1"))
    aopened: list[str | None] = []
    atransport = _streams_cut_inside_an_event(aopened, keep)
    async with AsyncClient("http://gw", transport=atransport, max_retries=1) as aclient:
        with pytest.raises(Unreachable, match="inside an event"):
            _ = [event async for event in aclient.events("t1")]
    assert opened == aopened == [None, "0"], f"one try and one retry each, resumed after queued: {opened}, {aopened}"


def _refused_then_completed(opened: list[float]) -> httpx.MockTransport:
    """An event stream refused with a Retry-After of an hour (a proxy's 503), then, if asked again, the task's end."""

    def handler(request: httpx.Request) -> httpx.Response:
        opened.append(time.monotonic())
        if len(opened) == 1:
            refusal = {"error": {"code": "overloaded", "message": "full"}}
            return httpx.Response(503, json=refusal, headers={"Retry-After": "3600"})
        body = state_event(state(TaskStatus.COMPLETED, output="x"))
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


async def test_an_event_stream_waits_no_retry_after_longer_than_the_clients_timeout() -> None:
    """As a call whose Retry-After would pass its deadline raises at once, rather than wait it out."""
    opened: list[float] = []
    client = Client("http://gw", timeout=1, transport=_refused_then_completed(opened))
    with client, pytest.raises(Overloaded) as refused:
        list(client.events("t1"))
    assert refused.value.retry_after_s == 3600.0 and len(opened) == 1, f"reconnected after {opened}"
    aopened: list[float] = []
    async with AsyncClient("http://gw", timeout=1, transport=_refused_then_completed(aopened)) as aclient:
        with pytest.raises(Overloaded):
            [event async for event in aclient.events("t1")]
    assert len(aopened) == 1, f"reconnected after {aopened}"


def test_lines_split_across_chunks_and_a_crlf_cut_in_two_end_once() -> None:
    lines = _Lines()
    assert lines.feed("event: queued\r") == []
    assert lines.feed("\ndata: {}\r\n\r\ndata: x\u2028y") == ["event: queued", "data: {}", ""]
    assert lines.feed("\n") == ["data: x\u2028y"]


def test_a_stream_waits_out_quiet_between_the_servers_pings_whatever_the_calls_timeout() -> None:
    reads: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        reads.append(request.extensions["timeout"]["read"])
        return _stream_with_separators(request)

    with Client("http://gw", timeout=2, transport=httpx.MockTransport(handler), max_retries=0) as client:
        list(client.events("t1"))
    assert reads == [STREAM_READ_S], "a 2 s timeout would give up on a task that sits 15 s in one status"


def test_a_retried_long_poll_asks_for_no_more_than_the_time_left() -> None:
    asked: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(float(request.url.params["wait"]))
        if len(asked) == 1:
            refusal = {"error": {"code": "overloaded", "message": "full"}}
            return httpx.Response(503, json=refusal, headers={"Retry-After": "1"})
        return httpx.Response(200, json={"task_id": "t1", "status": "completed", "output": "x"})

    with Client("http://gw", transport=httpx.MockTransport(handler)) as client:
        assert client.result("t1", wait=1.5) == "x"
    # The first asks the whole wait (less the milliseconds before its send), the retry a second in what is left.
    assert 1.4 <= asked[0] <= 1.5 and asked[1] <= 0.5, f"the retry came a second in: asked {asked}"


def _refused_between_polls(answers: list[str]) -> httpx.MockTransport:
    """Every other poll refused (a 503, as while a gateway restarts), the others still queued; the
    sixth poll finds the task completed."""

    def handler(request: httpx.Request) -> httpx.Response:
        answers.append("refused" if len(answers) % 2 == 0 else "queued")
        if len(answers) == 6:
            return httpx.Response(200, json={"task_id": "t1", "status": "completed", "output": "x"})
        if answers[-1] == "refused":
            return httpx.Response(503, json={"error": {"code": "overloaded", "message": "full"}})
        return httpx.Response(200, json={"task_id": "t1", "status": "queued", "model": "sim"})

    return httpx.MockTransport(handler)


def test_a_long_wait_takes_refusals_between_polls_that_got_through_each_with_its_own_retries() -> None:
    answers: list[str] = []
    with Client("http://gw", transport=_refused_between_polls(answers), max_retries=1) as client:
        assert client.result("t1", wait=20) == "x"
    assert answers == ["refused", "queued"] * 3, "a poll that got through starts the retries over"


async def test_async_a_long_wait_takes_refusals_between_polls_that_got_through() -> None:
    answers: list[str] = []
    async with AsyncClient("http://gw", transport=_refused_between_polls(answers), max_retries=1) as client:
        assert await client.result("t1", wait=20) == "x"
    assert answers == ["refused", "queued"] * 3


def test_errors_cross_a_process_boundary_whole() -> None:
    """A process pool hands a call's failure back pickled."""
    refused = httpx.Response(
        503, json={"error": {"code": "overloaded", "message": "full"}}, headers={"Retry-After": "3"}
    )
    late = httpx.Response(504, json={"error": {"code": "deadline_exceeded", "message": "late", "task_id": "t1"}})
    for error in (error_of(refused), error_of(late)):
        for again in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
            assert (type(again), again.code, again.message, again.task_id, again.retry_after_s, str(again)) == (
                type(error),
                error.code,
                error.message,
                error.task_id,
                error.retry_after_s,
                str(error),
            )


def test_infer_many_starts_no_call_once_one_failed() -> None:
    """One thread: the failing call is the second; the eight after it are dropped, not sent."""
    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        text = json.loads(request.content)["input"]
        sent.append(text)
        if text == "bad":
            return httpx.Response(422, json={"error": {"code": "empty_input", "message": "no"}})
        return httpx.Response(200, json={"output": text[::-1]})

    mock = httpx.MockTransport(handler)
    with Client("http://gw", transport=mock, max_retries=0) as client, pytest.raises(InvalidRequest):
        client.infer_many(["ok", "bad", *(f"later-{n}" for n in range(8))], concurrency=1)
    assert sent == ["ok", "bad"]


def test_infer_many_interrupted_returns_at_once_not_after_the_calls_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while calls are in flight: the interrupt is raised at once, nothing more starts, and the
    calls in flight end on their own (here: their answers, released once the interrupt is out)."""
    started, release = threading.Event(), threading.Event()
    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content)["input"])
        started.set()
        release.wait(10)
        return httpx.Response(200, json={"output": "x"})

    def interrupted(futures: object) -> None:
        started.wait(10)
        raise KeyboardInterrupt

    monkeypatch.setattr(client_module, "wait_for", interrupted)
    with Client("http://gw", transport=httpx.MockTransport(handler), max_retries=0) as client:
        began = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            client.infer_many([f"input-{n}" for n in range(10)], concurrency=2)
        interrupted_after = time.monotonic() - began
        release.set()
    assert interrupted_after < 5, f"the interrupt waited {interrupted_after:.1f} s for the calls in flight"
    assert len(sent) <= 2, f"no call started after the interrupt: {sent}"


def _answered_at_once(polls: list[float]) -> httpx.MockTransport:
    """A server whose longest poll is 0: each ``?wait=`` answered at once with the task still queued."""

    def handler(request: httpx.Request) -> httpx.Response:
        polls.append(time.monotonic())
        return httpx.Response(200, json={"task_id": "t1", "status": "queued", "model": "sim"})

    return httpx.MockTransport(handler)


def test_polls_a_server_answers_at_once_are_spaced_not_a_busy_loop() -> None:
    polls: list[float] = []
    client = Client("http://gw", transport=_answered_at_once(polls), max_retries=0)
    with client, pytest.raises(DeadlineExceeded):
        client.result("t1", wait=1.2)
    gaps = [later - earlier for earlier, later in itertools.pairwise(polls)]
    assert 2 <= len(polls) <= 4, f"{len(polls)} polls in 1.2 s"
    assert all(gap >= POLL_EVERY_S * 0.9 for gap in gaps[:-1]), f"only the last, at the deadline, comes sooner: {gaps}"


async def test_async_polls_a_server_answers_at_once_are_spaced_not_a_busy_loop() -> None:
    polls: list[float] = []
    async with AsyncClient("http://gw", transport=_answered_at_once(polls), max_retries=0) as client:
        with pytest.raises(DeadlineExceeded):
            await client.result("t1", wait=1.2)
    assert 2 <= len(polls) <= 4, polls


def _a_proxys_page(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, text="<html><body>Welcome to the captive portal</body></html>")


async def test_a_success_that_is_not_the_apis_json_is_a_server_error() -> None:
    """A proxy's page answered 200 (or JSON without the field) is the client's typed error, never the
    caller's ``KeyError`` or ``JSONDecodeError``."""
    with Client("http://gw", transport=httpx.MockTransport(_a_proxys_page), max_retries=0) as client:
        calls: list[Any] = [lambda: client.infer("x"), lambda: client.submit("x"), lambda: client.result("t1", wait=0)]
        for call in calls:
            with pytest.raises(ServerError) as raised:
                call()
            assert raised.value.code == "invalid_answer" and "captive portal" in raised.value.message
    async with AsyncClient("http://gw", transport=httpx.MockTransport(_a_proxys_page), max_retries=0) as aclient:
        for acall in (aclient.infer("x"), aclient.submit("x"), aclient.result("t1", wait=0)):
            with pytest.raises(ServerError) as raised:
                await acall
            assert raised.value.code == "invalid_answer"
    wrong_shape = httpx.MockTransport(lambda request: httpx.Response(200, json=["olleh"]))
    with Client("http://gw", transport=wrong_shape, max_retries=0) as client, pytest.raises(ServerError) as raised:
        client.infer("x")
    assert raised.value.code == "invalid_answer" and raised.value.status == 200


def _corrupt_gzip(request: httpx.Request) -> httpx.Response:
    """A proxy's answer whose body its ``Content-Encoding`` does not describe."""
    media_type = "text/event-stream" if request.url.path.endswith("/events") else "application/json"
    return httpx.Response(200, content=b"not gzip", headers={"content-encoding": "gzip", "content-type": media_type})


async def test_an_answer_that_cannot_be_decoded_is_a_server_error_not_httpxs() -> None:
    """Every call, the event stream too, raises the client's typed error, never ``httpx.DecodingError``."""
    with Client("http://gw", transport=httpx.MockTransport(_corrupt_gzip), max_retries=0) as client:
        calls: list[Any] = [
            lambda: client.infer("x"),
            lambda: client.submit("x"),
            lambda: client.result("t1", wait=0),
            lambda: list(client.events("t1")),
        ]
        for call in calls:
            with pytest.raises(ServerError) as raised:
                call()
            assert raised.value.code == "invalid_answer" and "Content-Encoding" in raised.value.message, raised.value
    async with AsyncClient("http://gw", transport=httpx.MockTransport(_corrupt_gzip), max_retries=0) as aclient:

        async def events() -> None:
            _ = [event async for event in aclient.events("t1")]

        for acall in (aclient.infer("x"), aclient.submit("x"), aclient.result("t1", wait=0), events()):
            with pytest.raises(ServerError) as araised:
                await acall
            assert araised.value.code == "invalid_answer", araised.value


def _a_proxys_page_then_the_task(opened: list[str]) -> httpx.MockTransport:
    """A captive portal's page answered 200 to the first few event streams asked for, then the task's end."""

    def handler(request: httpx.Request) -> httpx.Response:
        opened.append(request.url.path)
        if len(opened) <= 3:
            return _a_proxys_page(request)
        body = state_event(state(TaskStatus.COMPLETED, output="x"))
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


async def _events_refused_once(transport: Callable[[list[str]], httpx.MockTransport]) -> list[ServerError]:
    """What ``events`` raises over ``transport``, from the sync client and the async one; each asked once."""
    opened: list[str] = []
    with Client("http://gw", transport=transport(opened)) as client, pytest.raises(ServerError) as raised:
        list(client.events("t1"))
    aopened: list[str] = []
    async with AsyncClient("http://gw", transport=transport(aopened)) as aclient:
        with pytest.raises(ServerError) as araised:
            _ = [event async for event in aclient.events("t1")]
    assert len(opened) == len(aopened) == 1, f"asked once each: {opened}, {aopened}"
    return [raised.value, araised.value]


async def test_an_event_stream_answered_with_a_proxys_page_is_a_server_error_not_reconnected_for_ever() -> None:
    """A page is no event stream: read as one it carried no event, so ``events`` took it for a stream the
    gateway ended before the task and reconnected for as long as the page came, spending no retry."""
    for error in await _events_refused_once(_a_proxys_page_then_the_task):
        assert error.code == "invalid_answer" and "captive portal" in error.message, error


def _no_content(opened: list[str]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        opened.append(request.url.path)
        return httpx.Response(204)

    return httpx.MockTransport(handler)


async def test_a_204_before_the_terminal_event_is_a_server_error_not_an_end() -> None:
    """The gateway answers 204 only to a resume after the terminal event, which this client never makes:
    ``events`` ended silently, its caller left with no terminal status, contrary to "the terminal one last"."""
    for error in await _events_refused_once(_no_content):
        assert error.code == "invalid_answer" and "204" in error.message, error


async def test_a_submit_with_no_time_left_is_refused_unsent() -> None:
    """A timeout of 0 or less (or NaN) would queue a task already past its deadline: nothing is sent."""
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json={"task_id": "t1", "status": "completed", "output": "olleh"})

    with Client("http://gw", transport=httpx.MockTransport(handler)) as client:
        for timeout in (0.0, -1.0, math.nan):
            for call in (client.infer, client.submit):
                with pytest.raises(DeadlineExceeded, match="nothing was sent"):
                    call("x", timeout=timeout)
        assert client.result("t1", wait=0) == "olleh", "a wait of 0 still reads"
    async with AsyncClient("http://gw", transport=httpx.MockTransport(handler)) as aclient:
        for timeout in (0.0, -1.0):
            with pytest.raises(DeadlineExceeded, match="nothing was sent"):
                await aclient.infer("x", timeout=timeout)
            with pytest.raises(DeadlineExceeded, match="nothing was sent"):
                await aclient.submit("x", timeout=timeout)
    assert [request.url.path for request in sent] == ["/v1/result/t1"], "only the read went out"
