"""GET /v1/result/{task_id}/events over a real uvicorn server (streaming needs a real socket)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from httpx_sse import ServerSentEvent, aconnect_sse

from batchwire.transport.base import TransportError
from schemas.records import TaskState
from tests.gateway.rig import RecordingStore, RigFactory, error_of, serving, wait_until


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
        await wait_until(lambda: rig.gateway.watchers == 0, what="the server to stop the abandoned stream")


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
