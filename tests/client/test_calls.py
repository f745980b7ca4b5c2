"""``batchwire.client`` against ``batchwire up``: each mode, its errors, retries and resumed streams.

The servers are real (tests/client/conftest.py); what the tests put between client and server is an
httpx transport that records each attempt, or cuts an event stream after its first event as a
dropped connection would.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
import pytest

from batchwire.client import (
    API_KEY_ENV,
    AsyncClient,
    AsyncTask,
    Client,
    DeadlineExceeded,
    InvalidRequest,
    NotCancellable,
    NotFound,
    Task,
    TaskEvent,
    TaskFailed,
    Unauthorized,
    Unreachable,
)
from infra.ports import free_port
from schemas.records import TaskStatus
from schemas.wire import IDEMPOTENCY_HEADER
from tests.client.conftest import OPERATOR_KEY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ORDER = [status.value for status in TaskStatus]
UNKNOWN_TASK = "q3bY0h2mXw1kL9aF5cZr6Q"


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def occupy(client: Client) -> Task:
    """Submits a task and returns once it runs: the one worker is then busy for about a second, so a
    task submitted next waits, queued, and its stream has states to show."""
    blocker = client.submit(unique("busy"))
    seen = []
    for event in blocker.events():
        seen.append(event.status)
        if event.status == "running":
            return blocker
    raise AssertionError(f"the blocker ended without being seen running: {seen}")


async def occupy_async(client: AsyncClient) -> AsyncTask:
    """:func:`occupy`, for an :class:`AsyncClient`."""
    blocker = await client.submit(unique("busy"))
    seen = []
    async for event in blocker.events():
        seen.append(event.status)
        if event.status == "running":
            return blocker
    raise AssertionError(f"the blocker ended without being seen running: {seen}")


def assert_each_status_once_in_order(events: list[TaskEvent], text: str) -> None:
    statuses = [event.status for event in events]
    ids = [event.id for event in events]
    assert ids == sorted(set(ids)), f"event ids repeat or go back: {ids} ({statuses})"
    assert statuses == sorted(statuses, key=ORDER.index), f"statuses out of order: {statuses}"
    assert [e.id for e in events] == [TaskStatus(s).rank for s in statuses], f"ids are not the ranks: {events}"
    assert statuses[-1] == "completed", f"the stream did not end with the task's end: {statuses}"
    assert events[-1].terminal and events[-1].output == text[::-1], events[-1]


# the three modes --------------------------------------------------------------------------------------
def test_infer_returns_the_output(server: str) -> None:
    text = unique("hello")
    with Client(server) as client:
        assert client.infer(text) == text[::-1]


async def test_async_infer_returns_the_output(server: str) -> None:
    text = unique("hello")
    async with AsyncClient(server) as client:
        assert await client.infer(text, model="sim", priority="high") == text[::-1]


def test_submit_then_result(server: str) -> None:
    text = unique("polled")
    with Client(server) as client:
        task = client.submit(text)
        assert task.id, task
        assert task.result(wait=20) == text[::-1]
        assert client.task(task.id).result(wait=0) == text[::-1], "an ended task answers at once"


async def test_async_submit_then_result(server: str) -> None:
    text = unique("polled")
    async with AsyncClient(server) as client:
        task = await client.submit(text)
        assert await task.result(wait=20) == text[::-1]


def test_events_deliver_each_status_once_and_end_with_the_terminal_one(slow_server: str) -> None:
    text = unique("streamed")
    with Client(slow_server) as client:
        occupy(client)
        events = list(client.submit(text).events())
    assert events[0].status == "queued", f"a task behind a busy worker starts queued: {events}"
    assert "running" in [e.status for e in events], events
    assert_each_status_once_in_order(events, text)


async def test_async_events_deliver_each_status_once_and_end_with_the_terminal_one(slow_server: str) -> None:
    text = unique("streamed")
    async with AsyncClient(slow_server) as client:
        await occupy_async(client)
        task = await client.submit(text)
        events = [event async for event in task.events()]
    assert events[0].status == "queued", f"a task behind a busy worker starts queued: {events}"
    assert_each_status_once_in_order(events, text)


# resumed event streams --------------------------------------------------------------------------------
@dataclass
class Cut:
    """The event streams a transport opened: each one's ``Last-Event-ID``, and how many it cut."""

    last_event_ids: list[str | None]
    cut: int = 0

    def opened(self, request: httpx.Request) -> bool:
        """Records a stream's request; True for the first, which is to be cut."""
        self.last_event_ids.append(request.headers.get("Last-Event-ID"))
        return len(self.last_event_ids) == 1


def first_event_end(data: bytes) -> int:
    end = data.find(b"\r\n\r\n")
    return -1 if end < 0 else end + 4


class CutAfterFirstEvent(httpx.SyncByteStream):
    """Passes the stream on up to the end of its first event, then closes it and raises what httpx
    raises when the peer drops the connection."""

    def __init__(self, inner: httpx.SyncByteStream, cut: Cut) -> None:
        self.inner = inner
        self.cut = cut

    def __iter__(self) -> Iterator[bytes]:
        read = b""
        for chunk in self.inner:
            end = first_event_end(read + chunk)
            if end < 0:
                read += chunk
                yield chunk
                continue
            yield chunk[: end - len(read)]
            self.inner.close()
            self.cut.cut += 1
            raise httpx.RemoteProtocolError("the test dropped the connection after the first event")

    def close(self) -> None:
        self.inner.close()


class CuttingTransport(httpx.HTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.streams = Cut([])

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if not request.url.path.endswith("/events") or not self.streams.opened(request):
            return response
        assert isinstance(response.stream, httpx.SyncByteStream)
        cut = CutAfterFirstEvent(response.stream, self.streams)
        return httpx.Response(
            response.status_code, headers=response.headers, stream=cut, extensions=response.extensions
        )


class AsyncCutAfterFirstEvent(httpx.AsyncByteStream):
    """:class:`CutAfterFirstEvent`, for the async transport."""

    def __init__(self, inner: httpx.AsyncByteStream, cut: Cut) -> None:
        self.inner = inner
        self.cut = cut

    async def __aiter__(self) -> AsyncIterator[bytes]:
        read = b""
        async for chunk in self.inner:
            end = first_event_end(read + chunk)
            if end < 0:
                read += chunk
                yield chunk
                continue
            yield chunk[: end - len(read)]
            await self.inner.aclose()
            self.cut.cut += 1
            raise httpx.RemoteProtocolError("the test dropped the connection after the first event")

    async def aclose(self) -> None:
        await self.inner.aclose()


class AsyncCuttingTransport(httpx.AsyncHTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.streams = Cut([])

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if not request.url.path.endswith("/events") or not self.streams.opened(request):
            return response
        assert isinstance(response.stream, httpx.AsyncByteStream)
        cut = AsyncCutAfterFirstEvent(response.stream, self.streams)
        return httpx.Response(
            response.status_code, headers=response.headers, stream=cut, extensions=response.extensions
        )


def assert_resumed(events: list[TaskEvent], streams: Cut, text: str) -> None:
    assert streams.cut == 1, f"the first stream was not cut: {streams}"
    assert len(streams.last_event_ids) == 2, f"expected one reconnection, saw streams {streams.last_event_ids}"
    assert streams.last_event_ids[0] is None, "a first connection has read nothing to resume after"
    assert streams.last_event_ids[1] == str(events[0].id), (
        f"the reconnection resumed after {streams.last_event_ids[1]}, but the event read before the cut was {events[0]}"
    )
    assert not events[0].terminal, f"the cut came after the task ended: nothing was left to resume: {events}"
    assert_each_status_once_in_order(events, text)


def test_events_resume_after_a_dropped_connection_without_repeating_a_status(slow_server: str) -> None:
    text = unique("resumed")
    transport = CuttingTransport()
    with Client(slow_server) as plain, Client(slow_server, transport=transport) as client:
        occupy(plain)
        events = list(client.submit(text).events())
    assert_resumed(events, transport.streams, text)


async def test_async_events_resume_after_a_dropped_connection_without_repeating_a_status(slow_server: str) -> None:
    text = unique("resumed")
    transport = AsyncCuttingTransport()
    async with AsyncClient(slow_server) as plain, AsyncClient(slow_server, transport=transport) as client:
        await occupy_async(plain)
        task = await client.submit(text)
        events = [event async for event in task.events()]
    assert_resumed(events, transport.streams, text)


# errors ------------------------------------------------------------------------------------------------
def test_events_go_on_through_streams_the_server_ends_before_the_task(short_streams_server: str) -> None:
    """The server ends each stream after --sse-max-s; one that ended with nothing new spends no retry, so a
    task that waits through more such streams than max_retries is followed to its end."""
    text = unique("outlasts")
    with Client(short_streams_server) as plain, Client(short_streams_server, max_retries=1) as client:
        occupy(plain)
        events = list(client.submit(text).events())
    assert events and events[-1].status == "completed", f"the task's end was not delivered: {events}"
    assert_each_status_once_in_order(events, text)


def test_bad_requests_raise_typed_errors_with_the_servers_code(server: str) -> None:
    with Client(server) as client:
        with pytest.raises(InvalidRequest) as empty:
            client.infer("")
        assert (empty.value.code, empty.value.status) == ("empty_input", 422), empty.value
        with pytest.raises(NotFound) as model:
            client.submit("x", model="no-such-model")
        assert (model.value.code, model.value.status) == ("unknown_model", 404), model.value
        with pytest.raises(InvalidRequest) as priority:
            client.infer("x", priority="urgent")  # type: ignore[arg-type]  # what an untyped caller may send
        assert priority.value.code == "invalid_priority", priority.value


async def test_an_input_no_utf_8_holds_raises_invalid_request_with_the_servers_code_unsent(server: str) -> None:
    """A lone surrogate (text decoded with ``surrogateescape``, a JSON ``\\ud800``) is no UTF-8 text: the
    server refuses it written as a JSON escape, and httpx cannot encode it at all, which raised its bare
    ``UnicodeEncodeError`` from inside httpx; the client raises the server's error for it, unsent."""
    async with httpx.AsyncClient(base_url=server) as raw:
        escaped = await raw.post(
            "/v1/inference", content=b'{"input": "ab\\ud800"}', headers={"content-type": "application/json"}
        )
    assert (escaped.status_code, escaped.json()["error"]["code"]) == (400, "invalid_json"), escaped.text
    text = "ab\udc80cd"
    with Client(server) as client:
        for call in (client.infer, client.submit):
            with pytest.raises(InvalidRequest) as refused:
                call(text)
            assert (refused.value.code, refused.value.status) == ("invalid_json", None), refused.value
            assert "index 2" in refused.value.message, refused.value
    async with AsyncClient(server) as aclient:
        with pytest.raises(InvalidRequest, match="invalid_json"):
            await aclient.infer(text)
        with pytest.raises(InvalidRequest, match="invalid_json"):
            await aclient.submit(text)


async def test_an_input_over_the_body_limit_raises_invalid_request_at_once(server: str) -> None:
    """The client writes a whole body before it reads; the gateway answers a body over its limit before
    it came, and reads the rest and drops it so that the client reads that answer. It raised
    DeadlineExceeded after its whole timeout, having sent the body again (the 413 lost to a reset).
    The client's socket holds little of the body, as across a network: loopback buffers hold megabytes."""
    options = [(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)]
    text = "z" * (4 * 1024 * 1024)  # the server's limit is 1 MiB
    began = time.monotonic()
    async with AsyncClient(server, transport=httpx.AsyncHTTPTransport(socket_options=options)) as client:
        with pytest.raises(InvalidRequest) as large:
            await client.infer(text)
    took_s = time.monotonic() - began
    assert (large.value.code, large.value.status) == ("body_too_large", 413), large.value
    assert took_s < 5.0, f"the 413 came after {took_s:.1f} s"
    began = time.monotonic()
    with (
        Client(server, transport=httpx.HTTPTransport(socket_options=options)) as sync_client,
        pytest.raises(InvalidRequest) as sync_large,
    ):
        sync_client.infer(text)
    took_s = time.monotonic() - began
    assert (sync_large.value.code, sync_large.value.status) == ("body_too_large", 413), sync_large.value
    assert took_s < 5.0, f"the sync client's 413 came after {took_s:.1f} s"


def test_an_unknown_task_is_not_found_by_each_route(server: str) -> None:
    with Client(server) as client:
        task = client.task(UNKNOWN_TASK)
        for call in (lambda: task.result(wait=0), lambda: next(task.events()), task.cancel):
            with pytest.raises(NotFound) as missing:
                call()
            assert (missing.value.code, missing.value.status) == ("task_not_found", 404), missing.value


async def test_async_unknown_task_is_not_found(server: str) -> None:
    async with AsyncClient(server) as client:
        with pytest.raises(NotFound) as missing:
            await client.result(UNKNOWN_TASK, wait=0)
        assert missing.value.code == "task_not_found", missing.value
        with pytest.raises(NotFound):
            await anext(client.events(UNKNOWN_TASK))


def test_a_cancelled_task_ends_cancelled_and_its_result_raises(slow_server: str) -> None:
    with Client(slow_server) as client:
        occupy(client)
        task = client.submit(unique("doomed"))
        task.cancel()
        with pytest.raises(TaskFailed) as failed:
            task.result(wait=10)
        assert (failed.value.task_status, failed.value.task_id) == ("cancelled", task.id), failed.value
        events = list(task.events())
        assert [(e.id, e.status) for e in events] == [(3, "cancelled")], events
        task.cancel()  # again: the answer is its cancelled state
        finished = client.submit(unique("after"))
        finished.result(wait=20)
        with pytest.raises(NotCancellable) as ended:
            finished.cancel()
        assert (ended.value.code, ended.value.status) == ("not_cancellable", 409), ended.value


def test_a_missed_deadline_names_the_task_whose_result_then_raises_task_failed(slow_server: str) -> None:
    with Client(slow_server) as client:
        # A worker skips an item its call would finish late only once it knows its call time: one call first,
        # so that this test does not depend on another test of the module having run before it.
        warm = unique("warm")
        assert client.infer(warm) == warm[::-1]
        with pytest.raises(DeadlineExceeded) as late:
            client.infer(unique("late"), timeout=0.2)  # one call of the model takes a second
        assert (late.value.status, late.value.code) == (504, "deadline_exceeded"), late.value
        assert late.value.task_id is not None, "a 504 names the task, to poll"
        with pytest.raises(TaskFailed) as expired:
            client.task(late.value.task_id).result(wait=20)  # too short for any call: it expires, never computed
    assert (expired.value.task_status, expired.value.code) == ("expired", "deadline_exceeded"), expired.value
    assert expired.value.status is None, "a task that ended badly comes in a 200"


def test_an_endless_wait_or_timeout_is_a_wait_without_deadline_or_refused_by_the_server(server: str) -> None:
    """``wait=math.inf`` waits for the task's end, as ``AsyncClient`` did; a submit's endless timeout gets the
    server's refusal of any timeout past its longest, as a huge finite one does. Both overflowed a socket's
    timeout or ``math.ceil`` (OverflowError)."""
    text = unique("endless")
    with Client(server) as client:
        assert client.submit(text).result(wait=math.inf) == text[::-1]
        with pytest.raises(InvalidRequest) as endless:
            client.infer(text, timeout=math.inf)
    assert endless.value.code == "timeout_out_of_range", endless.value
    with Client(server, timeout=math.inf) as endless_client:
        events = list(endless_client.events(endless_client.submit(text, timeout=10).id))
    assert events and events[-1].status == "completed", events


TIMEOUT_NOTE = "the client sends each call's timeout (seconds) as timeout_ms: pass a shorter timeout"


def test_a_client_timeout_past_the_server_s_longest_is_refused_naming_the_client_s_setting(server: str) -> None:
    """The server's message speaks of ``timeout_ms``, which a caller of the client never wrote."""
    with Client(server, timeout=60) as client, pytest.raises(InvalidRequest) as long:
        client.infer(unique("long"))
    assert long.value.code == "timeout_out_of_range", long.value
    assert getattr(long.value, "__notes__", []) == [TIMEOUT_NOTE], long.value


async def test_async_a_client_timeout_past_the_server_s_longest_names_the_client_s_setting(server: str) -> None:
    async with AsyncClient(server) as client:
        with pytest.raises(InvalidRequest) as long:
            await client.submit(unique("long"), timeout=60)
    assert getattr(long.value, "__notes__", []) == [TIMEOUT_NOTE], long.value


async def test_async_an_endless_wait_or_timeout_is_a_wait_without_deadline_or_refused(server: str) -> None:
    text = unique("endless")
    async with AsyncClient(server) as client:
        assert await (await client.submit(text)).result(wait=math.inf) == text[::-1]
        with pytest.raises(InvalidRequest) as endless:
            await client.infer(text, timeout=math.inf)
    assert endless.value.code == "timeout_out_of_range", endless.value


def test_a_result_not_ready_within_wait_raises_deadline_exceeded(slow_server: str) -> None:
    with Client(slow_server) as client:
        occupy(client)
        task = client.submit(unique("waited"))
        with pytest.raises(DeadlineExceeded) as waiting:
            task.result(wait=0)
        assert (waiting.value.task_id, waiting.value.status) == (task.id, None), waiting.value


# retries -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Attempt:
    path: str
    key: str | None
    sent_s: float
    answered_s: float
    status: int
    retry_after: str | None


class RecordingTransport(httpx.AsyncHTTPTransport):
    """Real connections; records each attempt: its Idempotency-Key, when it went and came back, the status."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts: list[Attempt] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        sent = time.monotonic()
        response = await super().handle_async_request(request)
        key = request.headers.get(IDEMPOTENCY_HEADER)
        retry_after = response.headers.get("Retry-After")
        attempt = Attempt(request.url.path, key, sent, time.monotonic(), response.status_code, retry_after)
        self.attempts.append(attempt)
        return response


async def inflight(metrics: httpx.AsyncClient) -> float:
    text = (await metrics.get("/metrics")).text
    return next(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("batchwire_inflight_requests ")
    )


async def test_a_503_is_retried_after_retry_after_with_the_same_idempotency_key(refusing_server: str) -> None:
    holder_text, text = unique("holder"), unique("retried")
    transport = RecordingTransport()
    headers = {"Authorization": f"Bearer {OPERATOR_KEY}"}
    async with (
        AsyncClient(refusing_server, api_key=OPERATOR_KEY) as holder_client,
        AsyncClient(refusing_server, api_key=OPERATOR_KEY, transport=transport) as client,
        httpx.AsyncClient(base_url=refusing_server, headers=headers, timeout=10) as metrics,
    ):
        holding = asyncio.create_task(holder_client.infer(holder_text))
        async with asyncio.timeout(20):
            while True:
                if await inflight(metrics) >= 1:  # the gateway holds its one request: the next gets 503
                    break
                await asyncio.sleep(0.005)
        output = await client.infer(text)
        assert await holding == holder_text[::-1]
    assert output == text[::-1]
    attempts = transport.attempts
    assert len(attempts) >= 2 and attempts[0].status == 503, f"expected a 503, then a retry: {attempts}"
    assert attempts[-1].status == 200, attempts
    keys = {attempt.key for attempt in attempts}
    assert len(keys) == 1 and None not in keys, f"every attempt of one call carries its one key: {attempts}"
    for refused, retry in itertools.pairwise(attempts):
        assert refused.retry_after is not None, f"a 503 without Retry-After: {refused}"
        waited = retry.sent_s - refused.answered_s
        assert waited >= float(refused.retry_after), f"retried {waited:.3f} s after {refused}, before its Retry-After"


class DroppingTransport(httpx.HTTPTransport):
    """Real connections; the first submit's answer is lost: the server answered, the transport closes
    the connection unread and raises what httpx raises when a peer drops it. Records every answer."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: list[tuple[str | None, int, str | None, dict[str, object]]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.method != "POST":
            return response
        response.read()
        replayed = response.headers.get("Idempotent-Replayed")
        self.answers.append((request.headers.get(IDEMPOTENCY_HEADER), response.status_code, replayed, response.json()))
        if len(self.answers) == 1:
            response.close()
            raise httpx.RemoteProtocolError("the test dropped the connection before the answer", request=request)
        return response


def test_a_submit_whose_answer_is_lost_is_retried_and_answered_from_its_first_task(server: str) -> None:
    transport = DroppingTransport()
    with Client(server, transport=transport) as client:
        task = client.submit(unique("dropped"))
    (first_key, first_status, _, first), (key, status, replayed, again) = transport.answers
    assert (first_status, status) == (202, 202), transport.answers
    assert first_key is not None and key == first_key, f"the retry carried another key: {transport.answers}"
    assert replayed == "true" and task.id == again["task_id"] == first["task_id"], (
        f"the retry was not answered from the first attempt's task: {transport.answers}"
    )


def test_an_inference_whose_answer_is_lost_is_retried_and_computed_once(server: str) -> None:
    text = unique("dropped")
    transport = DroppingTransport()
    with Client(server, transport=transport) as client:
        assert client.infer(text) == text[::-1]
    (first_key, _, _, first), (key, status, replayed, again) = transport.answers
    assert key == first_key and (status, replayed) == (200, "true"), transport.answers
    assert again["task_id"] == first["task_id"], f"the retry ran another task: {transport.answers}"


class ImpatientProxy(httpx.HTTPTransport):
    """Real connections, behind a proxy whose timeout is shorter than the call's: the first submit reaches
    the gateway, and the proxy gives up on its answer after ``PROXY_TIMEOUT_S``, answering its own 504 page."""

    PROXY_TIMEOUT_S = 0.2

    def __init__(self) -> None:
        super().__init__()
        self.answers: list[tuple[str | None, int, str | None]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        key = request.headers.get(IDEMPOTENCY_HEADER)
        if not self.answers:
            request.extensions["timeout"] = {**request.extensions.get("timeout", {}), "read": self.PROXY_TIMEOUT_S}
            try:
                super().handle_request(request).read()
            except httpx.ReadTimeout:
                self.answers.append((key, 504, None))
                return httpx.Response(504, text="<html><h1>504 Gateway Time-out</h1></html>", request=request)
            raise AssertionError("the gateway answered within the proxy's timeout: the call was not slow enough")
        response = super().handle_request(request)
        self.answers.append((key, response.status_code, response.headers.get("Idempotent-Replayed")))
        return response


def test_a_proxys_504_before_the_calls_deadline_is_retried_and_answered_from_the_first_task(slow_server: str) -> None:
    text = unique("proxy-timeout")
    transport = ImpatientProxy()
    with Client(slow_server, transport=transport) as client:
        assert client.infer(text) == text[::-1]
    first, *retries = transport.answers
    assert first[1] == 504 and retries, f"expected the proxy's 504, then a retry: {transport.answers}"
    assert {key for key, _, _ in transport.answers} == {first[0]}, f"one key for every attempt: {transport.answers}"
    assert retries[-1][1:] == (200, "true"), f"the retry was not answered from the first task: {transport.answers}"


class CountingAttempts(httpx.HTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.tries = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.tries += 1
        return super().handle_request(request)


def test_where_nothing_listens_a_call_is_unreachable_after_max_retries() -> None:
    transport = CountingAttempts()
    nowhere = f"http://127.0.0.1:{free_port()}"
    with Client(nowhere, max_retries=2, transport=transport) as client, pytest.raises(Unreachable) as unreachable:
        client.infer("x")
    assert transport.tries == 3, f"expected the call and 2 retries, saw {transport.tries} attempts"
    assert isinstance(unreachable.value.__cause__, httpx.ConnectError), unreachable.value.__cause__


RESTART_S = 3.2
"""How long the gateway of ``Restarting`` refuses connections: a supervisor's restart of it (a kill -9 and a
respawn over Kafka took about 2 s on a quiet machine), and longer than the backoff alone of the default
retries (at most 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s)."""


class Restarting(httpx.HTTPTransport):
    """Real connections to a gateway that refuses them for ``RESTART_S`` from the first one, as a gateway
    being restarted does."""

    def __init__(self) -> None:
        super().__init__()
        self.back_at: float | None = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.back_at = self.back_at or time.monotonic() + RESTART_S
        if time.monotonic() < self.back_at:
            raise httpx.ConnectError("[Errno 111] Connection refused (the gateway restarts)", request=request)
        return super().handle_request(request)


class AsyncRestarting(httpx.AsyncHTTPTransport):
    """:class:`Restarting`, awaited."""

    def __init__(self) -> None:
        super().__init__()
        self.back_at: float | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.back_at = self.back_at or time.monotonic() + RESTART_S
        if time.monotonic() < self.back_at:
            raise httpx.ConnectError("[Errno 111] Connection refused (the gateway restarts)", request=request)
        return await super().handle_async_request(request)


async def test_calls_ride_through_a_gateway_restart_within_their_deadline(server: str) -> None:
    """A lost connection is retried after a second (``RECONNECT_S``), as an event stream reconnects: the
    default retries' backoff alone spanned 1.5 s on average, so a call with most of its deadline left
    raised Unreachable while the gateway was restarting (``result(wait=25)`` after 2 s, where the same
    client's ``events`` rode through)."""
    queued = unique("restart-queued")
    with Client(server) as client:
        task = client.submit(queued)
    with Client(server, transport=Restarting()) as client:
        assert client.result(task.id, wait=20) == queued[::-1]
    text = unique("restart")
    with Client(server, transport=Restarting()) as client:
        assert client.infer(text) == text[::-1]
    async with AsyncClient(server, transport=AsyncRestarting()) as aclient:
        assert await aclient.infer(text) == text[::-1]


class ResetOnce(httpx.HTTPTransport):
    """Real connections, but the first request's is reset before its answer, as a keep-alive connection
    the server closed just as it was reused is (encode/httpcore#1110)."""

    def __init__(self) -> None:
        super().__init__()
        self.reset = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not self.reset:
            self.reset = True
            raise httpx.ReadError("[Errno 104] Connection reset by peer", request=request)
        return super().handle_request(request)


def test_a_connection_reset_is_retried_at_once_within_a_short_deadline(server: str) -> None:
    """Only a refused connection (nothing listens: a restart) waits ``RECONNECT_S``; a reset one (a stale
    keep-alive connection) is retried after the backoff alone, so a call of a second still gets its answer."""
    text = unique("reset")
    with Client(server, transport=ResetOnce()) as client:
        assert client.infer(text, timeout=1.0) == text[::-1]


def test_events_opened_while_the_gateway_restarts_ride_through(server: str) -> None:
    """A stream's first connection, refused before any ``retry:`` was read, waits ``RECONNECT_S`` too, not
    the backoff alone, which gave up within 2 s of a restart."""
    text = unique("restart-events")
    with Client(server) as client:
        task = client.submit(text)
    with Client(server, transport=Restarting()) as client:
        events = list(client.events(task.id))
    assert events and events[-1].status == "completed" and events[-1].output == text[::-1], events


async def test_infer_many_keeps_the_unreachable_errors_cause() -> None:
    """Unreachable's ``__cause__`` is the last connection's failure, raised by ``infer_many`` too."""
    nowhere = f"http://127.0.0.1:{free_port()}"
    with Client(nowhere, max_retries=0) as client, pytest.raises(Unreachable) as unreachable:
        client.infer_many(["x", "y"])
    assert isinstance(unreachable.value.__cause__, httpx.ConnectError), unreachable.value.__cause__
    async with AsyncClient(nowhere, max_retries=0) as aclient:
        with pytest.raises(Unreachable) as aunreachable:
            await aclient.infer_many(["x", "y"])
    assert isinstance(aunreachable.value.__cause__, httpx.ConnectError), aunreachable.value.__cause__


def test_without_its_key_the_server_refuses_and_the_key_comes_from_the_environment(
    refusing_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with Client(refusing_server) as client, pytest.raises(Unauthorized) as refused:
        client.infer("x")
    assert (refused.value.code, refused.value.status) == ("unauthorized", 401), refused.value
    monkeypatch.setenv(API_KEY_ENV, OPERATOR_KEY)
    text = unique("keyed")
    with Client(refusing_server) as client:
        assert client.infer(text) == text[::-1]


def test_a_key_read_with_its_line_end_is_sent_without_it_and_one_no_header_carries_is_refused_unsent(
    refusing_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key read from a file (a mounted secret) keeps the file's line end, which no header may carry:
    the server strips its own keys, so the client strips the key too, and a key with a character no
    header carries is refused when the client is made, not retried as an unreachable server."""
    monkeypatch.setenv(API_KEY_ENV, f"{OPERATOR_KEY}\n")
    text = unique("keyed")
    with Client(refusing_server, max_retries=1) as client:
        assert client.infer(text) == text[::-1]
    for bad in (f"{OPERATOR_KEY[:8]} {OPERATOR_KEY[8:]}", f"{OPERATOR_KEY}\u00e9", f"{OPERATOR_KEY}\x7f"):
        with pytest.raises(ValueError, match="API key") as refused:
            Client(refusing_server, api_key=bad)
        assert OPERATOR_KEY[:8] not in str(refused.value), "the message shows the key"
        with pytest.raises(ValueError, match="API key"):
            AsyncClient(refusing_server, api_key=bad)


# infer_many ------------------------------------------------------------------------------------------
class CountingTransport(httpx.HTTPTransport):
    """Real connections; counts the submits in flight at once (an answer comes when the output is ready)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        try:
            return super().handle_request(request)
        finally:
            with self.lock:
                self.now -= 1


def test_infer_many_answers_500_inputs_in_order_with_bounded_concurrency(server: str) -> None:
    inputs = [unique(f"item{n}") for n in range(500)]
    transport = CountingTransport()
    with Client(server, transport=transport) as client:
        outputs = client.infer_many(inputs, concurrency=16)
    assert outputs == [text[::-1] for text in inputs], "outputs are not each input's, in input order"
    assert 1 < transport.peak <= 16, f"expected up to 16 calls in flight at once, saw {transport.peak}"


async def test_async_infer_many_answers_500_inputs_in_order(server: str) -> None:
    inputs = [unique(f"item{n}") for n in range(500)]
    async with AsyncClient(server) as client:
        outputs = await client.infer_many(inputs, concurrency=16)
    assert outputs == [text[::-1] for text in inputs], "outputs are not each input's, in input order"


async def test_async_infer_many_raises_the_first_error(server: str) -> None:
    async with AsyncClient(server) as client:
        with pytest.raises(InvalidRequest) as bad:
            await client.infer_many(["fine", "", "also fine"])
    assert bad.value.code == "empty_input", bad.value
    assert getattr(bad.value, "__notes__", []) == ["infer_many: inputs[1] failed"], "the error names the input to fix"


def test_infer_many_names_the_input_whose_call_failed(server: str) -> None:
    """Among hundreds of inputs, the server's message alone does not say which one to fix."""
    inputs = [unique(f"item{n}") for n in range(40)]
    inputs[17] = ""
    with Client(server) as client, pytest.raises(InvalidRequest) as bad:
        client.infer_many(inputs, concurrency=4)
    assert bad.value.code == "empty_input", bad.value
    assert getattr(bad.value, "__notes__", []) == ["infer_many: inputs[17] failed"], bad.value
