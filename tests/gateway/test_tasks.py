"""POST /v1/tasks and GET /v1/result/{task_id}: submit, poll, long-poll."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx
import pytest

from schemas.records import TaskState, TaskStatus
from tests.support.eventually import eventually
from tests.support.gateway_rig import (
    RecordingStore,
    RigFactory,
    StalledStore,
    deadline_passed_on,
    error_of,
    http_scope,
    now_ms,
)
from transport.errors import StoreFullError


async def test_submit_answers_202_with_where_to_look(make_rig: RigFactory) -> None:
    rig = await make_rig()
    response = await rig.client.post("/v1/tasks", json={"input": "later"})
    assert response.status_code == 202, response.text
    body = response.json()
    task_id = body["task_id"]
    assert body == {
        "task_id": task_id,
        "status": "queued",
        "result_url": f"/v1/result/{task_id}",
        "events_url": f"/v1/result/{task_id}/events",
    }
    assert response.headers["location"] == body["result_url"]
    assert rig.produced() == 1
    polled = await rig.client.get(body["result_url"])
    assert polled.status_code == 200
    assert polled.json() == {"task_id": task_id, "status": "queued", "model": "sim"}


async def test_poll_after_completion_has_the_output(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await rig.worker()
    task_id = (await rig.client.post("/v1/tasks", json={"input": "abc"})).json()["task_id"]
    done = await rig.client.get(f"/v1/result/{task_id}", params={"wait": 10})
    assert done.json() == {"task_id": task_id, "status": "completed", "model": "sim", "output": "cba", "batch_size": 1}


async def test_long_poll_wakes_on_completion_well_before_the_wait(make_rig: RigFactory) -> None:
    rig = await make_rig()
    worker = await rig.worker()
    worker.gate.clear()
    task_id = (await rig.client.post("/v1/tasks", json={"input": "wake me"})).json()["task_id"]
    started = time.monotonic()
    poll = asyncio.create_task(rig.client.get(f"/v1/result/{task_id}", params={"wait": 30}))
    await eventually(lambda: rig.gateway.watchers == 1, "the long-poll to be waiting")
    assert not poll.done(), "a long-poll must wait while the task is queued"
    worker.gate.set()
    response = await asyncio.wait_for(poll, 10)
    elapsed = time.monotonic() - started
    assert response.json()["status"] == "completed", response.text
    assert response.json()["output"] == "em ekaw"
    assert elapsed < 10, f"the long-poll returned after {elapsed:.1f} s; it should wake on completion"
    assert rig.gateway.watchers == 0


async def test_long_poll_that_runs_out_returns_the_latest_state(make_rig: RigFactory) -> None:
    rig = await make_rig()
    task_id = (await rig.client.post("/v1/tasks", json={"input": "nobody works"})).json()["task_id"]
    started = time.monotonic()
    response = await rig.client.get(f"/v1/result/{task_id}", params={"wait": 0.2})
    elapsed = time.monotonic() - started
    assert response.status_code == 200
    assert response.json()["status"] == "queued"
    assert 0.19 <= elapsed < 5, f"expected to wait about 0.2 s, waited {elapsed:.3f} s"


async def test_a_task_no_batcher_takes_ends_expired_at_its_deadline_and_a_long_poll_says_so(
    make_rig: RigFactory,
) -> None:
    """No batcher runs (none here): a long-poll answers ``expired`` at the deadline, not ``queued`` later."""
    rig = await make_rig()
    task_id = (await rig.client.post("/v1/tasks", json={"input": "nobody", "timeout_ms": 300})).json()["task_id"]
    started = time.monotonic()
    body = (await rig.client.get(f"/v1/result/{task_id}", params={"wait": 10})).json()
    elapsed = time.monotonic() - started
    assert body["status"] == "expired" and body["error"]["code"] == "deadline_exceeded", body
    assert elapsed < 5, f"answered {elapsed:.1f} s in; the deadline was 0.3 s after the submit"
    stored = await rig.store.get(task_id)
    assert stored is not None and stored.status is TaskStatus.EXPIRED, f"the store holds the end: {stored}"
    again = (await rig.client.get(f"/v1/result/{task_id}")).json()
    assert again == body, "a poll reads the same end"


async def test_a_submit_to_a_store_that_does_not_answer_is_a_504_at_its_deadline_and_its_end_lands_when_back(
    make_rig: RigFactory,
) -> None:
    """A task's record cannot be written, so its deadline passes while it is being queued: the 504 comes
    within a client's grace of the deadline (``batchwire.client.GRACE_S``), not after the store's own
    timeout, and the task's ``expired`` end lands once the store answers."""
    store = StalledStore()
    rig = await make_rig(store=store)
    task_id = await deadline_passed_on(rig, "/v1/tasks", "x", 0.3)
    store.back.set()
    await eventually(lambda: any(s.task_id == task_id for s in store.applied), "the task's end to be written")
    polled = await rig.client.get(f"/v1/result/{task_id}")
    assert polled.status_code == 200 and polled.json()["status"] == "expired", polled.text


async def test_a_long_poll_on_a_store_that_stops_answering_is_a_503_when_its_wait_runs_out(
    make_rig: RigFactory,
) -> None:
    """A long-poll asked for ``wait`` seconds: a store that does not answer (its subscribe or its read
    stuck until a socket timeout, or for good) answers 503 ``unavailable`` then, not seconds later."""
    store = StalledStore()
    store.back.set()
    rig = await make_rig(store=store)
    task_id = (await rig.client.post("/v1/tasks", json={"input": "x", "timeout_ms": 30_000})).json()["task_id"]
    store.back.clear()
    wait_s = 0.3
    started = time.monotonic()
    async with asyncio.timeout(10):
        response = await rig.client.get(f"/v1/result/{task_id}", params={"wait": wait_s})
    elapsed = time.monotonic() - started
    assert response.status_code == 503, response.text
    error = error_of(response)
    assert error["code"] == "unavailable" and "task store" in error["message"], error
    assert elapsed < wait_s + 1.0, f"answered {elapsed - wait_s:.2f} s past the wait"
    assert rig.gateway.watchers == 0, "the watch is closed"
    store.back.set()


async def test_a_batched_task_past_its_deadline_reads_expired_and_a_running_one_does_not(make_rig: RigFactory) -> None:
    """A batch waiting for a worker that is hung or gone: its task ends at its deadline. A running task
    is its worker's to end (its answer may still come), as is one recorded with no deadline."""
    rig = await make_rig()
    past = now_ms() - 5_000  # past its deadline by more than the grace (--reply-recheck-s) a read gives
    waiting = TaskState("waits", TaskStatus.BATCHED, "sim", past, past - 1000, batch_id="b1", deadline_ms=past)
    running = TaskState("runs", TaskStatus.RUNNING, "sim", past, past - 1000, batch_id="b1", worker_id="w1")
    unbounded = TaskState("late", TaskStatus.QUEUED, "sim", past, past - 1000)
    await rig.store.apply([waiting, running, unbounded])
    polled = {task: (await rig.client.get(f"/v1/result/{task}")).json() for task in ("waits", "runs", "late")}
    assert polled["waits"]["status"] == "expired", polled["waits"]
    assert polled["waits"]["error"]["code"] == "deadline_exceeded", polled["waits"]
    assert polled["runs"]["status"] == "running", polled["runs"]
    assert polled["late"]["status"] == "queued", polled["late"]


async def test_failed_task_shows_its_error(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await rig.worker()
    task_id = (await rig.client.post("/v1/tasks", json={"input": "fail: now"})).json()["task_id"]
    body = (await rig.client.get(f"/v1/result/{task_id}", params={"wait": 10})).json()
    assert body["status"] == "failed"
    assert body["error"] == {"code": "backend_error", "message": "the model raised"}


async def test_unknown_task_is_404(make_rig: RigFactory) -> None:
    rig = await make_rig()
    for wait in (0, 0.5):
        response = await rig.client.get("/v1/result/NoSuchTask123", params={"wait": wait})
        assert response.status_code == 404, response.text
        assert error_of(response)["code"] == "task_not_found"


@pytest.mark.parametrize("task_id", ["bad!id", "x" * 129, "a%3Ab"])
async def test_malformed_task_id_is_400(make_rig: RigFactory, task_id: str) -> None:
    rig = await make_rig()
    response = await rig.client.get(f"/v1/result/{task_id}")
    assert response.status_code == 400, response.text
    assert error_of(response)["code"] == "invalid_task_id"


@pytest.mark.parametrize("wait", ["-1", "abc", "nan", "inf"])
async def test_bad_wait_is_422(make_rig: RigFactory, wait: str) -> None:
    rig = await make_rig()
    task_id = (await rig.client.post("/v1/tasks", json={"input": "x"})).json()["task_id"]
    response = await rig.client.get(f"/v1/result/{task_id}?wait={wait}")
    assert response.status_code == 422, response.text
    error = error_of(response)
    assert error["code"] == "validation_error"
    assert "wait" in error["message"]


async def test_beyond_max_watchers_is_503_overloaded(make_rig: RigFactory) -> None:
    rig = await make_rig(max_watchers=1)
    task_id = (await rig.client.post("/v1/tasks", json={"input": "x"})).json()["task_id"]
    first = asyncio.create_task(rig.client.get(f"/v1/result/{task_id}", params={"wait": 30}))
    await eventually(lambda: rig.gateway.watchers == 1, "the first long-poll to wait")
    second = await rig.client.get(f"/v1/result/{task_id}", params={"wait": 30})
    stream = await rig.client.get(f"/v1/result/{task_id}/events")
    plain = await rig.client.get(f"/v1/result/{task_id}")
    await rig.worker()
    assert (await asyncio.wait_for(first, 10)).json()["status"] == "completed"
    for refused in (second, stream):
        assert refused.status_code == 503, refused.text
        assert error_of(refused)["code"] == "overloaded"
        assert "BATCHWIRE_MAX_WATCHERS" in error_of(refused)["message"]
    assert plain.status_code == 200, "a plain poll holds nothing open and is never refused"


async def test_one_client_holds_only_its_share_of_the_watchers_and_another_is_still_served(
    make_rig: RigFactory,
) -> None:
    """A client that opens long-polls and streams up to its share is refused the next one, naming the
    share; a client at another address still gets its long-poll."""
    rig = await make_rig(max_watchers=10, max_watchers_per_client=2)
    task_id = (await rig.client.post("/v1/tasks", json={"input": "x"})).json()["task_id"]
    held = [asyncio.create_task(rig.client.get(f"/v1/result/{task_id}", params={"wait": 30})) for _ in range(2)]
    await eventually(lambda: rig.gateway.watchers == 2, "the first client's two long-polls to wait")
    over = await rig.client.get(f"/v1/result/{task_id}", params={"wait": 30})
    stream = await rig.client.get(f"/v1/result/{task_id}/events")
    for refused in (over, stream):
        assert refused.status_code == 503 and error_of(refused)["code"] == "overloaded", refused.text
        assert "BATCHWIRE_MAX_WATCHERS_PER_CLIENT" in error_of(refused)["message"], refused.text
    other = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=rig.app, client=("127.0.0.9", 4321)), base_url="http://gateway"
    )
    async with other:
        theirs = asyncio.create_task(other.get(f"/v1/result/{task_id}", params={"wait": 30}))
        await eventually(lambda: rig.gateway.watchers == 3, "the other client's long-poll to wait")
        await rig.worker()
        answered = await asyncio.wait_for(asyncio.gather(theirs, *held), 10)
    assert [response.json()["status"] for response in answered] == ["completed"] * 3
    assert rig.gateway.watchers == 0


async def test_a_client_at_its_share_of_the_watchers_still_gets_an_ended_task(make_rig: RigFactory) -> None:
    """An ended task needs no watch: a long-poll or stream of it at the client's share answers its state
    (a plain poll would), while one of a task still waiting is refused."""
    rig = await make_rig(max_watchers_per_client=1)
    waiting = (await rig.client.post("/v1/tasks", json={"input": "x"})).json()["task_id"]  # no worker: queued
    held = asyncio.create_task(rig.client.get(f"/v1/result/{waiting}", params={"wait": 30}))
    await eventually(lambda: rig.gateway.watchers == 1, "the client's long-poll to wait")
    cancelled = await rig.client.delete(
        f"/v1/result/{(await rig.client.post('/v1/tasks', json={'input': 'y'})).json()['task_id']}"
    )
    assert cancelled.status_code == 200, cancelled.text
    ended = cancelled.json()["task_id"]
    poll = await rig.client.get(f"/v1/result/{ended}", params={"wait": 30})
    stream = await rig.client.get(f"/v1/result/{ended}/events")
    refused = await rig.client.get(f"/v1/result/{waiting}", params={"wait": 30})
    held.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await held
    assert poll.status_code == 200 and poll.json()["status"] == "cancelled", poll.text
    assert stream.status_code == 200 and "event: cancelled" in stream.text, stream.text
    assert refused.status_code == 503 and error_of(refused)["code"] == "overloaded", refused.text


async def test_a_long_poll_whose_client_left_gives_back_its_watch_at_once(make_rig: RigFactory) -> None:
    """A client whose read timeout is shorter than its ``wait`` leaves; its watch counted against its
    share (and, behind a proxy, every client's) until the wait ran out."""
    rig = await make_rig(max_watchers_per_client=1)
    task_id = (await rig.client.post("/v1/tasks", json={"input": "x"})).json()["task_id"]  # no worker: queued
    left = asyncio.Event()
    messages = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, object]:
        if messages:
            return messages.pop()
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: object) -> None:
        return None

    path = f"/v1/result/{task_id}"
    poll = asyncio.create_task(rig.app(http_scope("GET", path, b"wait=60"), receive, send))
    await eventually(lambda: rig.gateway.watchers == 1, "the long-poll to wait")
    left.set()
    await asyncio.wait_for(poll, 5)
    assert rig.gateway.watchers == 0, "the watch goes with its client"
    again = await rig.client.get(path, params={"wait": 0.1})
    assert again.status_code == 200, again.text


class _RefusesEnds(RecordingStore):
    """A store that reads but refuses to end a task (Redis full: ``-OOM`` on every write)."""

    async def cancel(
        self, task_id: str, reason_code: str, message: str, status: TaskStatus = TaskStatus.CANCELLED
    ) -> TaskState | None:
        raise StoreFullError("OOM command not allowed when used memory > 'maxmemory'")


async def test_a_late_task_reads_as_stored_when_the_store_refuses_its_end(
    make_rig: RigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Ending a late task is a read's extra: a store that refuses writes still answers the read, and each
    refusal is one line (every watcher of a late task meets it at each re-read: no traceback each)."""
    rig = await make_rig(store=_RefusesEnds())
    past = now_ms() - 5_000  # past its deadline by more than the grace (--reply-recheck-s) a read gives
    await rig.store.apply([TaskState("waits", TaskStatus.QUEUED, "sim", past, past - 1000, deadline_ms=past)])
    with caplog.at_level(logging.WARNING, logger="gateway.answers.reads"):
        for wait in (0, 0.2):  # a poll, and a long-poll that reads the task again as it ends
            polled = await rig.client.get("/v1/result/waits", params={"wait": wait})
            assert polled.status_code == 200 and polled.json()["status"] == "queued", polled.text
    refusals = [r for r in caplog.records if "could not end late task waits" in r.getMessage()]
    assert refusals and all(r.exc_info is None and "OOM command not allowed" in r.getMessage() for r in refusals)


async def test_the_owner_cancels_a_late_task_that_no_one_ended(make_rig: RigFactory) -> None:
    """DELETE of a task still queued past its deadline cancels it (200), as before its deadline."""
    rig = await make_rig()
    past = now_ms() - 5_000  # past its deadline by more than the grace (--reply-recheck-s) a read gives
    await rig.store.apply([TaskState("waits", TaskStatus.QUEUED, "sim", past, past - 1000, deadline_ms=past)])
    response = await rig.client.delete("/v1/result/waits")
    assert response.status_code == 200 and response.json()["status"] == "cancelled", response.text


async def test_a_task_just_past_its_deadline_is_left_to_the_role_that_holds_it(make_rig: RigFactory) -> None:
    """Its batcher or worker ends it at its deadline, and its watchers learn it from the change: a read
    within ``--reply-recheck-s`` of the deadline writes nothing, so many watchers of tasks that end
    together cost the store no burst of writes (and the gateway no burst of connections)."""
    rig = await make_rig(reply_recheck_s=30.0)
    past = now_ms() - 1
    await rig.store.apply([TaskState("waits", TaskStatus.QUEUED, "sim", past, past - 1000, deadline_ms=past)])
    for wait in (0, 0.2):
        polled = await rig.client.get("/v1/result/waits", params={"wait": wait})
        assert polled.status_code == 200 and polled.json()["status"] == "queued", polled.text
    stored = await rig.store.get("waits")
    assert stored is not None and stored.status is TaskStatus.QUEUED, stored
