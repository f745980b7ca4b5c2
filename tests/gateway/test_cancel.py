"""DELETE /v1/result/{task_id}, and the synchronous caller who hangs up: both cancel a task no worker started."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from schemas.records import TaskState, TaskStatus
from tests.support.eventually import eventually
from tests.support.gateway_rig import RigFactory, error_of, now_ms, serving

pytestmark = pytest.mark.timeout(60)


async def _states_until(
    changes: AsyncIterator[TaskState], status: TaskStatus, timeout_s: float = 10
) -> list[TaskState]:
    seen: list[TaskState] = []
    async with asyncio.timeout(timeout_s):
        async for state in changes:
            seen.append(state)
            if state.status is status:
                return seen
    raise AssertionError("unreachable")


async def test_delete_cancels_a_queued_task(make_rig: RigFactory) -> None:
    rig = await make_rig()  # no worker: the task stays queued
    task_id = (await rig.client.post("/v1/tasks", json={"input": "never mind"})).json()["task_id"]

    response = await rig.client.delete(f"/v1/result/{task_id}")

    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "cancelled", body
    assert body["error"]["code"] == "cancelled"
    polled = (await rig.client.get(f"/v1/result/{task_id}")).json()
    assert polled == body, "the cancelled state is what polls see"
    again = await rig.client.delete(f"/v1/result/{task_id}")
    assert (again.status_code, again.json()) == (200, body), "DELETE is idempotent"


async def test_a_cancelled_task_stays_cancelled_whatever_a_worker_writes(make_rig: RigFactory) -> None:
    rig = await make_rig()
    worker = await rig.worker(progress=True)
    worker.gate.clear()  # the worker holds the batch it fetched
    task_id = (await rig.client.post("/v1/tasks", json={"input": "abc"})).json()["task_id"]
    await eventually(lambda: rig.produced() == 1, "the request on the bus")
    async with rig.store.watch(task_id) as changes:
        assert (await rig.client.delete(f"/v1/result/{task_id}")).status_code == 200
        worker.gate.set()
        await eventually(lambda: len(worker.seen) == 1, "the worker to reach the request")
        seen = await _states_until(changes, TaskStatus.CANCELLED)
        with pytest.raises(TimeoutError):  # every later update of the worker is refused
            async with asyncio.timeout(0.3):
                seen.append(await anext(changes))
    assert [s.status for s in seen] == [TaskStatus.CANCELLED], f"got {[s.status.value for s in seen]}"
    final = (await rig.client.get(f"/v1/result/{task_id}")).json()
    assert final["status"] == "cancelled", final


@pytest.mark.parametrize("status", ["running", "completed", "failed"])
async def test_delete_of_a_started_or_ended_task_is_409_naming_its_status(make_rig: RigFactory, status: str) -> None:
    rig = await make_rig()
    task_id = (await rig.client.post("/v1/tasks", json={"input": "x"})).json()["task_id"]
    current = await rig.store.get(task_id)
    assert current is not None
    await rig.store.apply([TaskState(task_id, TaskStatus(status), "sim", 2, current.enqueued_at_ms)])

    response = await rig.client.delete(f"/v1/result/{task_id}")

    assert response.status_code == 409, response.text
    error = error_of(response)
    assert error["code"] == "not_cancellable"
    assert f"is {status}" in error["message"], error
    assert error["task_id"] == task_id
    assert (await rig.client.get(f"/v1/result/{task_id}")).json()["status"] == status, "nothing changed"


async def test_delete_of_an_unknown_or_malformed_id(make_rig: RigFactory) -> None:
    rig = await make_rig()
    unknown = await rig.client.delete("/v1/result/NoSuchTask")
    assert unknown.status_code == 404, unknown.text
    assert error_of(unknown)["code"] == "task_not_found"
    malformed = await rig.client.delete("/v1/result/bad!id")
    assert malformed.status_code == 400, malformed.text
    assert error_of(malformed)["code"] == "invalid_task_id"
    assert rig.store.created == []


async def test_a_synchronous_caller_whose_task_is_cancelled_gets_409(make_rig: RigFactory) -> None:
    rig = await make_rig()  # no worker
    caller = asyncio.create_task(rig.client.post("/v1/inference", json={"input": "wait for me"}))
    await eventually(lambda: rig.gateway.waiting == 1, "the caller to wait")
    request = rig.only_request()
    task_id = request.task_id
    assert rig.store.created == [], "a synchronous request's task is first stored by the batcher"
    batched = TaskState(task_id, TaskStatus.BATCHED, request.model, now_ms(), request.enqueued_at_ms)
    assert await rig.store.apply([batched]) == [True]  # as the batcher would

    assert (await rig.client.delete(f"/v1/result/{task_id}")).status_code == 200
    response = await asyncio.wait_for(caller, 10)

    assert response.status_code == 409, response.text
    error = error_of(response)
    assert (error["code"], error["task_id"]) == ("task_cancelled", task_id)
    assert rig.gateway.waiting == 0
    assert rig.gateway.inflight == 0


def _raw_post(path: str, body: dict[str, object], headers: dict[str, str] | None = None) -> bytes:
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n"
    for name, value in (headers or {}).items():
        head += f"{name}: {value}\r\n"
    return (head + "\r\n").encode() + payload


async def test_a_synchronous_caller_who_hangs_up_has_its_task_cancelled(make_rig: RigFactory) -> None:
    rig = await make_rig(reply_recheck_s=0.05)  # callers are watched from 50 ms on
    async with serving(rig) as client:
        port = int(str(client.base_url).rsplit(":", 1)[1].rstrip("/"))
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_raw_post("/v1/inference", {"input": "hang up on me"}))
        await writer.drain()
        await eventually(lambda: rig.gateway.watched == 1, "the caller's connection to be watched")
        task_id = rig.only_request().task_id
        async with rig.store.watch(task_id) as changes:
            writer.close()
            await writer.wait_closed()
            seen = await _states_until(changes, TaskStatus.CANCELLED)
        assert seen[-1].error_code == "client_disconnected", seen[-1]
        await eventually(lambda: rig.gateway.waiting == 0 and rig.gateway.inflight == 0, "the caller to go")
        assert (await client.get(f"/v1/result/{task_id}")).json()["status"] == "cancelled"


async def test_a_caller_with_an_idempotency_key_who_hangs_up_keeps_its_task(make_rig: RigFactory) -> None:
    """The key announces a retry: the task runs on so that the retry gets its answer, and the caller who
    hung up, and a retry who hangs up while it waits for the same task, are let go (no longer held
    against ``max_inflight`` up to their deadline)."""
    rig = await make_rig(reply_recheck_s=0.05)
    async with serving(rig) as client:
        port = int(str(client.base_url).rsplit(":", 1)[1].rstrip("/"))
        writers = []
        for waiting in (1, 2):  # the first try, then a retry that waits for the same task
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_raw_post("/v1/inference", {"input": "retry me"}, {"Idempotency-Key": "k-hang-up"}))
            await writer.drain()
            writers.append(writer)
            await eventually(lambda n=waiting: rig.gateway.inflight == n, "the caller to wait")
        task_id = rig.store.created[-1].task_id
        assert len(rig.store.created) == 1, "the retry waits for the first try's task"
        await eventually(lambda: rig.gateway.watched == 1, "the first try's connection to be watched")
        for writer in writers:
            writer.close()
            await writer.wait_closed()
        await eventually(lambda: rig.gateway.inflight == 0 and rig.gateway.waiting == 0, "both callers to go")
        assert (await client.get(f"/v1/result/{task_id}")).json()["status"] == "queued", "not cancelled"
        await rig.worker()
        retry = await client.post("/v1/inference", json={"input": "retry me"}, headers={"Idempotency-Key": "k-hang-up"})
        assert retry.status_code == 200, retry.text
        assert retry.json()["task_id"] == task_id
        assert retry.json()["output"] == "em yrter"


async def test_a_caller_answered_in_time_is_not_cancelled(make_rig: RigFactory) -> None:
    rig = await make_rig(reply_recheck_s=0.05)
    worker = await rig.worker()
    worker.gate.clear()
    async with serving(rig) as client:
        pending = asyncio.create_task(client.post("/v1/inference", json={"input": "slow"}))
        await eventually(lambda: rig.gateway.watched == 1, "the caller's connection to be watched")
        worker.gate.set()
        response = await asyncio.wait_for(pending, 10)
    assert response.status_code == 200, response.text
    assert response.json()["output"] == "wols"
    await eventually(lambda: rig.gateway.watched == 0, "the watch to end once the answer was sent")
