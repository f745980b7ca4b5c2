"""POST /v1/inference: answers, deadlines, failed tasks, overload and a sick bus."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.clock import SystemClock
from gateway.publisher import TaskPublisher
from schemas.records import InferenceRequest, TaskState, TaskStatus
from tests.support.eventually import eventually
from tests.support.gateway_rig import (
    MODELS,
    DownProducer,
    RecordingStore,
    RigFactory,
    StalledStore,
    deadline_passed_on,
    error_of,
)
from transport.memory.requests import MemoryRequestBus
from transport.routing import Partitioner


async def test_each_caller_gets_the_reversal_of_its_own_input(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await rig.worker()
    inputs = [f"request number {i} / {'x' * (i % 7)}" for i in range(300)]
    responses = await asyncio.gather(*(rig.client.post("/v1/inference", json={"input": text}) for text in inputs))
    for text, response in zip(inputs, responses, strict=True):
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["output"] == text[::-1], f"{text!r} got another request's answer: {body}"
        assert body["model"] == "sim"
        assert body["batch_size"] >= 1
        assert body["latency_ms"] >= 0
    assert len({r.json()["task_id"] for r in responses}) == len(inputs), "task ids must be unique"
    assert rig.gateway.waiting == 0, "every waiter must be removed"
    assert rig.gateway.inflight == 0


async def test_a_named_model_is_used(make_rig: RigFactory) -> None:
    rig = await make_rig()
    worker = await rig.worker()
    response = await rig.client.post("/v1/inference", json={"input": "ab", "model": "echo", "timeout_ms": 5000})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "echo"
    assert worker.seen[0].model == "echo"


async def test_no_answer_by_the_deadline_is_a_504_with_the_task_id(make_rig: RigFactory) -> None:
    rig = await make_rig()  # no worker: nobody answers
    started = time.monotonic()
    response = await rig.client.post("/v1/inference", json={"input": "late", "timeout_ms": 100})
    elapsed = time.monotonic() - started
    assert response.status_code == 504, response.text
    error = error_of(response)
    assert error["code"] == "deadline_exceeded"
    assert 0.09 <= elapsed < 5, f"expected to give up at about 0.1 s, gave up after {elapsed:.3f} s"
    task = await rig.client.get(f"/v1/result/{error['task_id']}")
    assert task.json()["status"] == "queued", "the task was stored and stays pollable"
    assert rig.gateway.waiting == 0
    assert rig.gateway.inflight == 0


async def test_a_failed_task_answers_502_with_its_own_code(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await rig.worker()
    response = await rig.client.post("/v1/inference", json={"input": "fail: please"})
    assert response.status_code == 502, response.text
    error = error_of(response)
    assert error["code"] == "backend_error"
    assert error["message"] == "the model raised"
    assert error["task_id"]


@pytest.mark.parametrize(("code", "status"), [("input_too_long", 413), ("input_empty", 422)])
async def test_an_input_its_model_refused_answers_a_4xx_not_a_502_a_client_would_retry(
    make_rig: RigFactory, code: str, status: int
) -> None:
    """The caller's to change: sent again it fails again, and 502 reads as the server's failing."""
    rig = await make_rig()
    await rig.worker()
    response = await rig.client.post("/v1/inference", json={"input": f"refuse:{code}:"})
    assert response.status_code == status, response.text
    error = error_of(response)
    assert (error["code"], error["message"]) == (code, f"refused: {code}") and error["task_id"], error


async def test_an_expired_task_answers_504(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await rig.worker()
    response = await rig.client.post("/v1/inference", json={"input": "expire: now"})
    assert response.status_code == 504, response.text
    assert error_of(response)["code"] == "deadline_exceeded"


async def test_beyond_max_inflight_is_503_with_retry_after(make_rig: RigFactory) -> None:
    rig = await make_rig(max_inflight=1, retry_after_s=3)
    worker = await rig.worker()
    worker.gate.clear()  # hold the first request
    first = asyncio.create_task(rig.client.post("/v1/inference", json={"input": "first"}))
    await eventually(lambda: rig.gateway.inflight == 1, "the first request to be held")
    second = await rig.client.post("/v1/inference", json={"input": "second"})
    third = await rig.client.post("/v1/tasks", json={"input": "third"})
    worker.gate.set()
    assert (await asyncio.wait_for(first, 10)).status_code == 200
    for refused in (second, third):
        assert refused.status_code == 503, refused.text
        assert error_of(refused)["code"] == "overloaded"
        assert refused.headers["retry-after"] == "3"
    assert [r.input for r in worker.seen] == ["first"], "a refused request must not be produced"


async def test_a_down_bus_is_503_unavailable_and_the_task_is_marked_failed(make_rig: RigFactory) -> None:
    rig = await make_rig(producer=DownProducer())
    for path in ("/v1/inference", "/v1/tasks"):
        response = await rig.client.post(path, json={"input": "x"})
        assert response.status_code == 503, response.text
        error = error_of(response)
        assert error["code"] == "unavailable"
        assert "broker unreachable" in error["message"]
        assert response.headers["retry-after"] == "1"
        task = (await rig.client.get(f"/v1/result/{error['task_id']}")).json()
        assert task["status"] == "failed", "a task that never reached the bus must not stay queued"
        assert task["error"]["code"] == "unavailable"
    assert rig.gateway.waiting == 0
    assert rig.gateway.inflight == 0


class KnownDownProducer(DownProducer):
    """A bus whose circuit breaker is open: it knows it is down without trying."""

    def reachable(self) -> bool:
        return False

    async def send(self, request: InferenceRequest) -> None:
        raise AssertionError("a bus known to be down must not be sent to")


async def test_a_bus_known_to_be_down_is_503_at_once_and_nothing_is_stored(make_rig: RigFactory) -> None:
    rig = await make_rig(producer=KnownDownProducer(), retry_after_s=2)
    for path in ("/v1/inference", "/v1/tasks"):
        response = await rig.client.post(path, json={"input": "x"}, headers={"Idempotency-Key": f"k-{path[4:]}"})
        assert response.status_code == 503, response.text
        error = error_of(response)
        assert error["code"] == "unavailable"
        assert "request bus is unreachable" in error["message"] and "nothing was queued" in error["message"]
        assert "task_id" not in error, "no task was made, so none is named"
        assert response.headers["retry-after"] == "2"
    assert rig.store.created == [], "nothing is recorded for a request refused up front"
    assert rig.gateway.inflight == 0


async def test_requests_before_start_are_503_not_ready(make_rig: RigFactory) -> None:
    rig = await make_rig(start=False)
    response = await rig.client.post("/v1/inference", json={"input": "too early"})
    assert response.status_code == 503, response.text
    assert error_of(response)["code"] == "not_ready"
    assert rig.produced() == 0
    assert rig.store.created == []


class StuckProducer:
    """A bus that never acknowledges (a broker partition without a leader)."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def ready(self) -> bool:
        return True

    def reachable(self) -> bool:
        return True

    async def send(self, request: InferenceRequest) -> None:
        await asyncio.Event().wait()


async def test_a_stuck_bus_is_bounded_by_the_request_timeout(make_rig: RigFactory) -> None:
    rig = await make_rig(producer=StuckProducer())
    sync = await rig.client.post("/v1/inference", json={"input": "x", "timeout_ms": 50})
    assert sync.status_code == 504, sync.text
    assert error_of(sync)["code"] == "deadline_exceeded"
    # The 504 hands the task id out, and the bus may never have taken the request, so no batcher
    # would end it: it ends expired, never left queued.
    for response in (sync, await rig.client.post("/v1/tasks", json={"input": "x", "timeout_ms": 50})):
        assert response.status_code == 504, response.text
        assert error_of(response)["code"] == "deadline_exceeded"
        polled = await rig.client.get(f"/v1/result/{error_of(response)['task_id']}")
        assert polled.status_code == 200, polled.text
        assert polled.json()["status"] == "expired"
        # Ended, never to be computed: the answer says so and what to change, not to poll for it.
        message = error_of(response)["message"]
        assert "may still finish" not in message and "poll" not in message, message
        assert "request bus took the request" in message and "longer timeout_ms" in message, message
    assert rig.gateway.inflight == 0
    assert rig.gateway.waiting == 0


class DownStore(RecordingStore):
    """Redis refusing connections: every create fails, and the change feed's connection is down."""

    async def create(self, state: TaskState) -> bool:
        raise ConnectionRefusedError("redis refused the connection")

    def reachable(self) -> bool:
        return False


class FailingStore(DownStore):
    """A store whose connection looks up, but whose writes fail (found out only by trying)."""

    def reachable(self) -> bool:
        return True


async def test_a_down_store_is_503_naming_the_task_that_may_still_run(make_rig: RigFactory) -> None:
    """A queued task is stored and produced at once: when only the store fails, the request is on the
    bus, and the 503 says so and names the task, so the caller can poll it or retry with a key."""
    rig = await make_rig(store=FailingStore())
    response = await rig.client.post("/v1/tasks", json={"input": "x"})
    assert response.status_code == 503, response.text
    body = response.json()
    error = body["error"]
    assert error["code"] == "unavailable"
    assert "redis refused" in error["message"]
    assert "may still run" in error["message"], error["message"]
    assert rig.produced() == 1
    assert error.get("task_id"), f"the 503 must name the queued task: {body}"


async def test_a_synchronous_request_meets_an_unreachable_store_with_503_and_queues_nothing(
    make_rig: RigFactory,
) -> None:
    """Its answer would come through the store: held, it would only wait for its deadline. An
    asynchronous one is refused the same way: a store known down takes no task."""
    rig = await make_rig(store=DownStore())
    refused = await rig.client.post("/v1/tasks", json={"input": "x"})
    assert refused.status_code == 503 and error_of(refused)["code"] == "unavailable", refused.text
    assert rig.produced() == 0
    response = await rig.client.post("/v1/inference", json={"input": "x"})
    assert response.status_code == 503, response.text
    error = error_of(response)
    assert error["code"] == "unavailable"
    assert "unreachable" in error["message"] and "nothing was queued" in error["message"], error
    assert rig.produced() == 0
    assert rig.gateway.inflight == 0
    assert rig.gateway.waiting == 0


async def test_a_store_that_does_not_answer_holds_a_504_within_a_clients_grace_and_records_the_task_when_back(
    make_rig: RigFactory,
) -> None:
    """At a synchronous deadline the gateway writes the task's late "queued" record and reads its end;
    a store that does not answer must not hold the 504 past the shipped client's grace
    (``batchwire.client.GRACE_S``), or the caller gives up without the task id. The record goes on
    and lands once the store answers, so the 504's task id can be polled."""
    store = StalledStore()
    rig = await make_rig(store=store)  # no worker: nobody answers
    task_id = await deadline_passed_on(rig, "/v1/inference", "late", 0.3)
    store.back.set()
    await eventually(lambda: any(s.task_id == task_id for s in store.created), "the late record to be written")
    polled = await rig.client.get(f"/v1/result/{task_id}")
    assert polled.status_code == 200 and polled.json()["status"] == "queued", polled.text
    assert rig.gateway.waiting == 0 and rig.gateway.inflight == 0


class FullStore(RecordingStore):
    """A store whose server refuses every write for memory (Redis over its maxmemory)."""

    def refuses_writes(self) -> str | None:
        return "the result store is full (Redis uses 70.0 MiB, over its maxmemory of 64.0 MiB)"


async def test_a_full_store_refuses_every_submit_at_once_with_503_unavailable(make_rig: RigFactory) -> None:
    """A synchronous submit writes nothing before its answer, and a full store could not keep that
    answer: held, it would wait for its deadline. Every shape is refused alike, nothing queued."""
    rig = await make_rig(store=FullStore())
    for path in ("/v1/inference", "/v1/tasks"):
        response = await rig.client.post(path, json={"input": "x", "timeout_ms": 30_000})
        assert response.status_code == 503, response.text
        assert "retry-after" in response.headers
        error = error_of(response)
        assert error["code"] == "unavailable" and "result store is full" in error["message"], error
    assert rig.produced() == 0
    assert rig.gateway.inflight == 0


@pytest.mark.parametrize("started", [False, True], ids=["never started", "closed"])
async def test_a_late_write_outside_the_publishers_background_still_holds_its_caller_only_its_wait(
    started: bool,
) -> None:
    """A 504 due while the gateway closes (its background closed, or not started): the write runs where it
    is asked for, and still holds the caller ``wait_s`` at most, not the store's whole write bound."""
    store = StalledStore()
    producer = MemoryRequestBus(Partitioner(MODELS, 4)).producer()
    publisher = TaskPublisher(producer, store, SystemClock(), write_timeout_s=5.0)
    if started:
        await publisher.start()
        await publisher.close()
    queued = TaskState("t-late", TaskStatus.QUEUED, "sim", 1, 1, reply_to="gw")
    begun = time.monotonic()
    async with asyncio.timeout(10):
        await publisher.record_late(queued, wait_s=0.2)
        await publisher.end_unsent(queued, 100, wait_s=0.2)
    assert time.monotonic() - begun < 2.0, "each write held its caller past its wait"
