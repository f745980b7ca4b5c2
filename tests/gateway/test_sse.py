"""GET /v1/result/{task_id}/events over a real uvicorn server (streaming needs a real socket)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager

import httpx
from httpx_sse import ServerSentEvent, aconnect_sse

from gateway.edge.events import PING, EventStream, StreamsEnd, TaskEvents
from schemas.records import TaskState, TaskStatus
from tests.support.eventually import eventually
from tests.support.gateway_rig import RecordingStore, RigFactory, error_of, serving
from transport.ports import TransportError


async def collect(
    client: httpx.AsyncClient,
    task_id: str,
    on_event: asyncio.Event | None = None,
) -> list[ServerSentEvent]:
    events: list[ServerSentEvent] = []
    async with aconnect_sse(client, "GET", f"/v1/result/{task_id}/events") as source:
        assert source.response.status_code == 200
        assert source.response.headers["content-type"].startswith("text/event-stream")
        async for event in source.aiter_sse():
            events.append(event)
            if on_event is not None:
                on_event.set()
    return events


async def test_stream_follows_the_task_to_its_end_and_closes(make_rig: RigFactory) -> None:
    rig = await make_rig()
    worker = await rig.worker(progress=True)
    worker.gate.clear()
    async with serving(rig) as client:
        task_id = (await client.post("/v1/tasks", json={"input": "stream"})).json()["task_id"]
        first_seen = asyncio.Event()
        stream = asyncio.create_task(collect(client, task_id, first_seen))
        await asyncio.wait_for(first_seen.wait(), 10)
        worker.gate.set()
        events = await asyncio.wait_for(stream, 10)  # returns only because the server closed the stream
    assert [e.event for e in events] == ["queued", "batched", "running", "completed"]
    assert len({e.id for e in events}) == len(events), "each event needs its own id"
    final = json.loads(events[-1].data)
    assert final == {"task_id": task_id, "status": "completed", "model": "sim", "output": "maerts", "batch_size": 1}
    assert rig.gateway.watchers == 0


async def test_a_stream_of_a_task_no_batcher_takes_ends_expired_at_its_deadline(make_rig: RigFactory) -> None:
    rig = await make_rig()  # no worker, no batcher: nothing but its deadline ends the task
    async with serving(rig) as client:
        response = await client.post("/v1/tasks", json={"input": "nobody", "timeout_ms": 300})
        events = await asyncio.wait_for(collect(client, response.json()["task_id"]), 10)
    assert [e.event for e in events] == ["queued", "expired"], [(e.event, e.data) for e in events]
    assert json.loads(events[-1].data)["error"]["code"] == "deadline_exceeded"


async def test_late_connect_gets_the_current_state_first(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await rig.worker()
    async with serving(rig) as client:
        answer = (await client.post("/v1/inference", json={"input": "done already"})).json()
        events = await asyncio.wait_for(collect(client, answer["task_id"]), 10)
    assert [e.event for e in events] == ["completed"]
    assert json.loads(events[0].data)["output"] == "ydaerla enod"


async def test_unknown_task_is_a_json_404_not_a_stream(make_rig: RigFactory) -> None:
    rig = await make_rig()
    async with serving(rig) as client:
        response = await client.get("/v1/result/NoSuchTask/events")
    assert response.status_code == 404
    assert error_of(response)["code"] == "task_not_found"
    assert rig.gateway.watchers == 0


async def test_a_client_that_leaves_ends_its_stream(make_rig: RigFactory) -> None:
    rig = await make_rig()
    async with serving(rig) as client:
        task_id = (await client.post("/v1/tasks", json={"input": "abandoned"})).json()["task_id"]
        async with aconnect_sse(client, "GET", f"/v1/result/{task_id}/events") as source:
            first = await anext(source.aiter_sse())
            assert first.event == "queued"
            assert rig.gateway.watchers == 1
        await eventually(lambda: rig.gateway.watchers == 0, "the server to stop the abandoned stream")


async def test_a_cut_stream_resumes_after_its_last_event_with_each_status_once(make_rig: RigFactory) -> None:
    rig = await make_rig()
    worker = await rig.worker(progress=True)
    worker.gate.clear()
    async with serving(rig) as client:
        task_id = (await client.post("/v1/tasks", json={"input": "resumed"})).json()["task_id"]
        async with aconnect_sse(client, "GET", f"/v1/result/{task_id}/events") as source:
            before = await anext(source.aiter_sse())  # then the connection is cut
        assert (before.event, before.retry) == ("queued", 1000)
        await eventually(lambda: rig.gateway.watchers == 0, "the cut stream to close")
        resumed: list[ServerSentEvent] = []
        headers = {"Last-Event-ID": before.id}
        async with aconnect_sse(client, "GET", f"/v1/result/{task_id}/events", headers=headers) as source:
            await eventually(lambda: rig.gateway.watchers == 1, "the resumed stream to watch the task")
            worker.gate.set()
            async for event in source.aiter_sse():
                resumed.append(event)
    assert [e.event for e in [before, *resumed]] == ["queued", "batched", "running", "completed"]
    assert [int(e.id) for e in [before, *resumed]] == [0, 1, 2, 3]


async def test_a_resume_after_the_end_is_204_and_a_resume_after_a_passed_state_gets_the_current_one(
    make_rig: RigFactory,
) -> None:
    rig = await make_rig()
    await rig.worker()
    async with serving(rig) as client:
        task_id = (await client.post("/v1/inference", json={"input": "over"})).json()["task_id"]
        ended = await client.get(f"/v1/result/{task_id}/events", headers={"Last-Event-ID": "3"})
        async with aconnect_sse(
            client, "GET", f"/v1/result/{task_id}/events", headers={"Last-Event-ID": "0"}
        ) as source:
            caught_up = [event async for event in source.aiter_sse()]
    assert (ended.status_code, ended.content) == (204, b"")
    assert [(e.event, e.id) for e in caught_up] == [("completed", "3")]
    assert rig.gateway.watchers == 0


async def test_a_resumed_stream_with_nothing_new_opens_at_once(make_rig: RigFactory) -> None:
    """A client tells the gateway's quiet stream from a proxy's empty answer by this opening."""
    rig = await make_rig()  # no worker: the task stays queued
    async with serving(rig) as client:
        task_id = (await client.post("/v1/tasks", json={"input": "quiet"})).json()["task_id"]
        headers = {"Last-Event-ID": "0"}
        async with client.stream("GET", f"/v1/result/{task_id}/events", headers=headers) as response:
            first = await asyncio.wait_for(anext(response.aiter_bytes()), 5)
    assert first == PING, first


async def test_a_last_event_id_the_stream_never_sent_is_a_400_that_says_what_to_send(make_rig: RigFactory) -> None:
    rig = await make_rig()
    async with serving(rig) as client:
        task_id = (await client.post("/v1/tasks", json={"input": "x"})).json()["task_id"]
        answers = [
            await client.get(f"/v1/result/{task_id}/events", headers={b"Last-Event-ID": bad})
            for bad in (b"4", b"-1", b"one", "\xb2".encode("latin-1"), b"9" * 5000)
        ]
    assert [a.status_code for a in answers] == [400] * 5, "more digits than int() reads is a 400 too"
    assert {error_of(a)["code"] for a in answers} == {"invalid_last_event_id"}
    assert "Last-Event-ID" in error_of(answers[0])["message"]
    assert rig.gateway.watchers == 0


async def test_openapi_states_this_deployments_ping_and_longest_stream(make_rig: RigFactory) -> None:
    """A client written from the API reference must resume a stream that closes at BATCHWIRE_SSE_MAX_S without
    its terminal event, and expect a keep-alive comment as often as this deployment sends one."""
    rig = await make_rig(sse_ping_s=5.0, sse_max_s=120.0)
    spec = (await rig.client.get("/openapi.json")).json()
    described = spec["paths"]["/v1/result/{task_id}/events"]["get"]["responses"]["200"]["description"]
    assert "after 5 s of quiet" in described, described
    assert "after 120 s" in described and "BATCHWIRE_SSE_MAX_S" in described, described


async def test_pings_keep_an_idle_stream_alive(make_rig: RigFactory) -> None:
    rig = await make_rig(sse_ping_s=0.05)
    async with serving(rig) as client:
        task_id = (await client.post("/v1/tasks", json={"input": "idle"})).json()["task_id"]
        async with client.stream("GET", f"/v1/result/{task_id}/events") as response:
            seen = b""
            async for chunk in response.aiter_bytes():
                seen += chunk
                if b": ping" in seen:
                    break
    assert b"event: queued" in seen, seen
    assert b": ping" in seen


class BrokenFeedStore(RecordingStore):
    """The change feed fails (Redis PubSub reader died) right after the stream opened."""

    @asynccontextmanager
    async def watch(self, task_id: str) -> AsyncIterator[AsyncIterator[TaskState]]:
        async def feed() -> AsyncIterator[TaskState]:
            raise TransportError("task events unavailable: reader died")
            yield  # pragma: no cover - makes this an async generator

        yield feed()


async def test_a_store_failure_mid_stream_ends_it_with_an_error_event(make_rig: RigFactory) -> None:
    rig = await make_rig(store=BrokenFeedStore())
    async with serving(rig) as client:
        task_id = (await client.post("/v1/tasks", json={"input": "x"})).json()["task_id"]
        events = await asyncio.wait_for(collect(client, task_id), 10)
    assert [e.event for e in events] == ["queued", "error"]
    assert json.loads(events[1].data)["error"]["code"] == "unavailable"
    assert rig.gateway.watchers == 0


class UnsubscribableStore(RecordingStore):
    """Reads work, the change feed cannot subscribe (Redis PubSub reader dead, a SUBSCRIBE unconfirmed)."""

    def __init__(self) -> None:
        super().__init__()
        self.ended = asyncio.Event()

    async def apply(self, updates: Sequence[TaskState], *, counted: bool = True) -> list[bool]:
        applied = await super().apply(updates, counted=counted)
        if any(state.status.terminal for state in updates):
            self.ended.set()
        return applied

    @asynccontextmanager
    async def watch(self, task_id: str) -> AsyncIterator[AsyncIterator[TaskState]]:
        raise TransportError("did not confirm SUBSCRIBE within 5.0 s")
        yield  # pragma: no cover - makes this an async context manager's generator


async def test_an_ended_task_is_answered_though_the_change_feed_cannot_subscribe(make_rig: RigFactory) -> None:
    """An ended state never changes: a long-poll or a stream of it needs no feed, and a plain poll answers it
    meanwhile. A task that has not ended still gets 503 ``unavailable``: its end could not be followed."""
    store = UnsubscribableStore()
    rig = await make_rig(store=store)
    worker = await rig.worker()
    async with serving(rig) as client:
        done = (await client.post("/v1/tasks", json={"input": "abc"})).json()["task_id"]
        await asyncio.wait_for(store.ended.wait(), 10)
        polled = await client.get(f"/v1/result/{done}", params={"wait": 5})
        assert polled.status_code == 200 and polled.json()["output"] == "cba", polled.text
        events = await asyncio.wait_for(collect(client, done), 10)
        assert [e.event for e in events] == ["completed"], events

        worker.gate.clear()  # the worker takes no more
        waiting = (await client.post("/v1/tasks", json={"input": "x"})).json()["task_id"]
        refused = await client.get(f"/v1/result/{waiting}", params={"wait": 5})
        assert refused.status_code == 503 and error_of(refused)["code"] == "unavailable", refused.text
    assert rig.gateway.watchers == 0


async def test_a_closed_stream_leaves_no_reference_cycles(make_rig: RigFactory) -> None:
    """Everything a stream held is freed by reference counting when it ends, not left for a full
    garbage collection (which the tuned collector runs rarely): a burst's memory comes back at once."""
    rig = await make_rig()
    async with serving(rig) as client:
        ids = [(await client.post("/v1/tasks", json={"input": f"c{n}"})).json()["task_id"] for n in range(20)]
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for task_id in ids:
                async with aconnect_sse(client, "GET", f"/v1/result/{task_id}/events") as source:
                    assert (await anext(source.aiter_sse())).event == "queued"
            await eventually(lambda: rig.gateway.watchers == 0, "the streams to end")
            gc.collect()
            cyclic = Counter(type(obj).__name__ for obj in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    held = {name: count for name, count in cyclic.items() if name in ("EventStream", "Task", "CancelledError", "frame")}
    assert not held, f"a closed stream left reference cycles: {held}"


class Sent:
    """An ASGI ``send`` that keeps the messages, and a ``receive`` that waits until told the client left."""

    def __init__(self) -> None:
        self.messages: list[dict[str, object]] = []
        self.left = asyncio.Event()

    async def send(self, message: dict[str, object]) -> None:
        self.messages.append(message)

    async def receive(self) -> dict[str, object]:
        await self.left.wait()
        return {"type": "http.disconnect"}

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")  # type: ignore[misc]


async def endless(closed: list[bool]) -> AsyncIterator[bytes]:
    try:
        yield b"event: queued\r\n\r\n"
        await asyncio.Event().wait()
        yield b"never"
    finally:
        closed.append(True)


async def test_a_server_shutdown_ends_every_stream_and_tells_the_client() -> None:
    end = StreamsEnd()
    closed: list[bool] = []
    sent = Sent()
    stream = asyncio.create_task(
        EventStream(endless(closed), ping_s=60, end=end)({"method": "GET"}, sent.receive, sent.send)
    )
    await eventually(lambda: b"event: queued" in sent.body, "the first event")
    end.end()  # as the server's signal handler does
    await asyncio.wait_for(stream, 5)
    assert sent.messages[-1] == {"type": "http.response.body", "body": b""}, "the stream is ended, not cut"
    assert closed == [True], "the events are closed"


async def test_a_client_that_leaves_gets_nothing_more_and_its_events_are_closed() -> None:
    closed: list[bool] = []
    sent = Sent()
    stream = asyncio.create_task(EventStream(endless(closed), ping_s=60)({"method": "GET"}, sent.receive, sent.send))
    await eventually(lambda: b"event: queued" in sent.body, "the first event")
    sent.left.set()
    await asyncio.wait_for(stream, 5)
    assert sent.messages[-1]["type"] == "http.response.body" and sent.messages[-1].get("more_body") is True
    assert closed == [True]


async def test_head_gets_the_headers_alone_and_the_watch_is_closed() -> None:
    """A HEAD reads no event, yet the store watch that the first state came from is closed."""
    closed: list[bool] = []
    later = watched_states(closed)
    first = await anext(later)  # started, as TaskReads.events is once it gave the first state
    sent = Sent()
    stream = EventStream(TaskEvents(first, later), ping_s=60)
    await asyncio.wait_for(stream({"method": "HEAD"}, sent.receive, sent.send), 5)
    start, body = sent.messages
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]  # type: ignore[operator]
    assert body == {"type": "http.response.body", "body": b""}
    assert closed == [True], "the watch is closed"


async def watched_states(closed: list[bool]) -> AsyncGenerator[TaskState, None]:
    try:
        yield TaskState("t1", TaskStatus.QUEUED, "sim", 1, 1)
        await asyncio.Event().wait()
        yield TaskState("t1", TaskStatus.COMPLETED, "sim", 1, 2)
    finally:
        closed.append(True)


class LosesACancellation:
    """Events whose read loses the first cancellation it gets, as a redis-py send under Python 3.11's
    ``asyncio.wait_for`` can, and then waits again."""

    def __init__(self) -> None:
        self.first = True
        self.closed = False

    def __aiter__(self) -> LosesACancellation:
        return self

    async def __anext__(self) -> bytes:
        if self.first:
            self.first = False
            return b"event: queued\r\n\r\n"
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        await asyncio.Event().wait()
        return b"never"

    async def aclose(self) -> None:
        self.closed = True


async def test_a_stream_ends_even_when_a_cancellation_is_lost_below_it() -> None:
    events = LosesACancellation()
    sent = Sent()
    stream = asyncio.create_task(EventStream(events, ping_s=60)({"method": "GET"}, sent.receive, sent.send))
    await eventually(lambda: b"event: queued" in sent.body, "the first event")
    sent.left.set()
    await asyncio.wait_for(stream, 5)
    assert events.closed
