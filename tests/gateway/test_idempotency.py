"""Idempotency-Key: a retry gets the first request's task and answer, and nothing is computed twice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import pytest

from gateway.answers.reads import TaskReads
from gateway.clock import SystemClock
from gateway.errors import Unavailable
from gateway.keys import idempotency
from gateway.keys.replay import KeyedReplay
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from schemas.records import InferenceRequest, TaskState, TaskStatus
from schemas.wire import IDEMPOTENCY_HEADER, Names
from tests.support.eventually import eventually
from tests.support.gateway_rig import (
    MODELS,
    DownProducer,
    FakeWorker,
    RecordingStore,
    RigFactory,
    error_of,
    now_ms,
)
from transport.memory.requests import MemoryRequestBus
from transport.ports import STALE_AFTER_MS, KeyClaim, TransportError
from transport.redis.store import RedisTaskStore
from transport.routing import Partitioner

pytestmark = pytest.mark.timeout(60)


def _key(value: str) -> dict[str, str]:
    return {IDEMPOTENCY_HEADER: value}


async def test_a_synchronous_retry_gets_the_same_task_and_answer(make_rig: RigFactory) -> None:
    rig = await make_rig()
    worker = await rig.worker()
    first = await rig.client.post("/v1/inference", json={"input": "once"}, headers=_key("k-1"))
    retry = await rig.client.post("/v1/inference", json={"input": "once"}, headers=_key("k-1"))

    assert first.status_code == retry.status_code == 200, (first.text, retry.text)
    assert retry.json()["task_id"] == first.json()["task_id"]
    assert retry.json()["output"] == first.json()["output"] == "ecno"
    assert "idempotent-replayed" not in first.headers
    assert retry.headers["idempotent-replayed"] == "true"
    assert [r.input for r in worker.seen] == ["once"], "the retry must not be computed again"
    assert len(rig.store.created) == 1


async def test_a_retry_while_the_first_still_waits_waits_for_the_same_task(make_rig: RigFactory) -> None:
    rig = await make_rig()
    worker = await rig.worker()
    worker.gate.clear()
    first = asyncio.create_task(rig.client.post("/v1/inference", json={"input": "slow"}, headers=_key("k-2")))
    await eventually(lambda: rig.produced() == 1, "the first request on the bus")
    retries = [
        asyncio.create_task(rig.client.post("/v1/inference", json={"input": "slow"}, headers=_key("k-2")))
        for _ in range(5)
    ]
    await eventually(lambda: rig.gateway.inflight == 6, "the retries to wait")
    worker.gate.set()
    answers = [await asyncio.wait_for(task, 10) for task in (first, *retries)]

    assert {a.status_code for a in answers} == {200}, [a.text for a in answers]
    assert len({a.json()["task_id"] for a in answers}) == 1, "every retry names the first task"
    assert {a.json()["output"] for a in answers} == {"wols"}
    assert rig.produced() == 1, "one request reached the bus"
    assert len(worker.seen) == 1


async def test_an_asynchronous_retry_answers_202_with_the_same_task_and_its_status(make_rig: RigFactory) -> None:
    rig = await make_rig()
    first = await rig.client.post("/v1/tasks", json={"input": "later"}, headers=_key("k-3"))
    assert first.status_code == 202
    task_id = first.json()["task_id"]
    retry = await rig.client.post("/v1/tasks", json={"input": "later"}, headers=_key("k-3"))
    assert retry.status_code == 202, retry.text
    assert retry.json()["task_id"] == task_id
    assert retry.json()["status"] == "queued"
    assert retry.headers["location"] == f"/v1/result/{task_id}"
    assert retry.headers["idempotent-replayed"] == "true"

    await rig.worker()
    await rig.client.get(f"/v1/result/{task_id}", params={"wait": 10})
    done = await rig.client.post("/v1/tasks", json={"input": "later"}, headers=_key("k-3"))
    assert (done.json()["task_id"], done.json()["status"]) == (task_id, "completed")
    sync = await rig.client.post("/v1/inference", json={"input": "later"}, headers=_key("k-3"))
    assert (sync.status_code, sync.json()["output"]) == (200, "retal"), "a sync retry of an async task answers too"
    assert rig.produced() == 1


async def test_a_synchronous_retry_whose_deadline_passes_first_is_a_replayed_504(make_rig: RigFactory) -> None:
    rig = await make_rig()
    first = await rig.client.post("/v1/tasks", json={"input": "no worker yet"}, headers=_key("k-504"))
    retry = await rig.client.post(
        "/v1/inference", json={"input": "no worker yet", "timeout_ms": 200}, headers=_key("k-504")
    )

    assert retry.status_code == 504, retry.text
    assert error_of(retry)["task_id"] == first.json()["task_id"]
    assert retry.headers.get("idempotent-replayed") == "true", f"the earlier task's 504: {dict(retry.headers)}"


@pytest.mark.parametrize(
    "changed", [{"input": "other"}, {"input": "same", "model": "echo"}], ids=["other input", "other model"]
)
async def test_the_same_key_for_another_request_is_422(make_rig: RigFactory, changed: dict[str, Any]) -> None:
    rig = await make_rig()
    first = await rig.client.post("/v1/tasks", json={"input": "same"}, headers=_key("k-4"))
    assert first.status_code == 202
    reused = await rig.client.post("/v1/tasks", json=changed, headers=_key("k-4"))
    assert reused.status_code == 422, reused.text
    assert error_of(reused)["code"] == "idempotency_key_reused"
    assert rig.produced() == 1
    longer = await rig.client.post("/v1/tasks", json={"input": "same", "timeout_ms": 20_000}, headers=_key("k-4"))
    assert longer.json()["task_id"] == first.json()["task_id"], "timeout_ms is not part of what a key names"


@pytest.mark.parametrize(
    "key", ["", "has space", "x" * 256, "tab\tkey", "é"], ids=["empty", "space", "too long", "control", "non-ascii"]
)
async def test_a_malformed_key_is_400_and_nothing_is_stored(make_rig: RigFactory, key: str) -> None:
    rig = await make_rig()
    for path in ("/v1/inference", "/v1/tasks"):
        response = await rig.client.post(path, json={"input": "x"}, headers={IDEMPOTENCY_HEADER: key.encode("utf-8")})
        assert response.status_code == 400, response.text
        error = error_of(response)
        assert error["code"] == "invalid_idempotency_key"
        assert "255" in error["message"]
    assert rig.produced() == 0
    assert rig.store.created == []


async def test_two_keys_in_one_request_are_400_and_neither_is_claimed(make_rig: RigFactory) -> None:
    rig = await make_rig()
    for path in ("/v1/inference", "/v1/tasks"):
        response = await rig.client.post(
            path, json={"input": "x"}, headers=[(IDEMPOTENCY_HEADER, "k-a"), (IDEMPOTENCY_HEADER, "k-b")]
        )
        assert response.status_code == 400, f"{path}: expected 400 for two keys, got {response.text}"
        error = error_of(response)
        assert error["code"] == "invalid_idempotency_key"
        assert "2 Idempotency-Key headers" in error["message"], error["message"]
    assert rig.produced() == 0
    assert rig.store.created == []


async def test_a_bad_body_with_a_key_does_not_claim_it(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await rig.worker()
    bad = await rig.client.post("/v1/inference", json={"input": ""}, headers=_key("k-5"))
    assert bad.status_code == 422
    good = await rig.client.post("/v1/inference", json={"input": "fixed"}, headers=_key("k-5"))
    assert good.status_code == 200, "a refused request must leave its key free"
    assert good.json()["output"] == "dexif"


async def test_a_key_whose_request_never_reached_the_bus_is_released(make_rig: RigFactory) -> None:
    rig = await make_rig(producer=DownProducer())
    first = await rig.client.post("/v1/tasks", json={"input": "x"}, headers=_key("k-6"))
    assert first.status_code == 503
    second = await rig.client.post("/v1/tasks", json={"input": "x"}, headers=_key("k-6"))
    assert second.status_code == 503
    assert error_of(second)["task_id"] != error_of(first)["task_id"], "the retry must try again, not replay"


async def test_an_asynchronous_retry_of_a_bound_task_that_was_never_stored_sends_it_and_it_ends(
    make_rig: RigFactory, key_store: RedisTaskStore | None
) -> None:
    """The first submit bound its key and then failed or died before it stored its task, and maybe
    before it sent its request (its claim's answer was lost with a failed-over Redis primary, or its
    gateway was killed): the retry's 202 names that task, and the retry sends it, so it ends."""
    rig = await make_rig(store=key_store)
    store = key_store if key_store is not None else rig.store
    worker = await rig.worker()
    model = rig.settings.default_model
    await store.claim_key(
        idempotency.ANONYMOUS_SCOPE, "k-lost", "lost-record", idempotency.fingerprint("lost", model), now_ms() + 30_000
    )
    retry = await rig.client.post("/v1/tasks", json={"input": "lost"}, headers=_key("k-lost"))
    assert (retry.status_code, retry.json()["task_id"]) == (202, "lost-record"), retry.text
    assert retry.headers["idempotent-replayed"] == "true"
    read = await rig.client.get("/v1/result/lost-record", params={"wait": 10})
    assert (read.status_code, read.json()["status"], read.json().get("output")) == (200, "completed", "tsol"), read.text
    again = await rig.client.post("/v1/tasks", json={"input": "lost"}, headers=_key("k-lost"))
    assert again.json()["task_id"] == "lost-record", "the task is replayed from then on, not replaced"
    assert [r.input for r in worker.seen] == ["lost"]


class _FullOnceStore(RecordingStore):
    """Refuses the first keyed submit for room (``full``: 503 ``overloaded``), and holds the release of
    its key until ``released`` is set, so that a second submit with the key claims it meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.claims = 0
        self.released = asyncio.Event()
        self._refused = False

    def full(self, model: str) -> str | None:
        if self._refused:
            return None
        self._refused = True
        return "the test's store is full"

    async def claim_key(
        self, scope: str, key: str, task_id: str, fingerprint: str, deadline_ms: int | None = None
    ) -> KeyClaim:
        self.claims += 1
        return await super().claim_key(scope, key, task_id, fingerprint, deadline_ms)

    async def release_key(self, scope: str, key: str, task_id: str) -> None:
        await self.released.wait()
        await super().release_key(scope, key, task_id)


async def test_a_retry_of_a_task_whose_submit_was_refused_meanwhile_starts_the_one_task_of_its_key(
    make_rig: RigFactory,
) -> None:
    """Two submits with one key at once: the first binds the key, is refused 503 and releases it,
    never storing its task; the second, which found the key bound to that task, must not send it
    (the key no longer names it, so a later retry would compute the input again): it claims anew."""
    store = _FullOnceStore()
    rig = await make_rig(store=store)
    worker = await rig.worker()
    first = asyncio.create_task(rig.client.post("/v1/tasks", json={"input": "twice"}, headers=_key("k-race")))
    await eventually(lambda: store.claims == 1, "the first submit to bind the key")
    second = asyncio.create_task(rig.client.post("/v1/tasks", json={"input": "twice"}, headers=_key("k-race")))
    await eventually(lambda: store.claims == 2, "the second submit to find the key bound")
    store.released.set()
    refused, accepted = await asyncio.wait_for(first, 10), await asyncio.wait_for(second, 10)
    assert refused.status_code == 503, refused.text
    assert accepted.status_code == 202, accepted.text
    read = await rig.client.get(f"/v1/result/{accepted.json()['task_id']}", params={"wait": 10})
    assert read.json()["status"] == "completed", read.text
    later = await rig.client.post("/v1/tasks", json={"input": "twice"}, headers=_key("k-race"))
    assert later.json()["task_id"] == accepted.json()["task_id"], (
        f"a later retry must name the key's one task {accepted.json()['task_id']}, got {later.text}"
    )
    assert [r.input for r in worker.seen] == ["twice"], "the input must be computed once"


# a key whose task ended without being computed -----------------------------------------------------


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.kafka)])
def key_store(request: pytest.FixtureRequest) -> RedisTaskStore | None:
    """Which store keeps the keys (None: the rig's memory store): the rule is the gateway's, the
    atomic re-binding the store's."""
    if request.param == "memory":
        return None
    stores: list[RedisTaskStore] = request.getfixturevalue("redis_stores")
    return stores[0]


async def _end(store: Any, task_id: str, status: TaskStatus, code: str) -> None:
    """Ends a queued task the way the batcher (expired) or the bus (failed, unavailable) would."""
    current = await store.get(task_id)
    assert current is not None, f"task {task_id} is not stored"
    ended = replace(current, status=status, error_code=code, error_message=f"ended {status.value} by the test")
    assert await store.apply([ended]) == [True]


async def test_a_retry_of_an_expired_task_with_a_longer_timeout_gets_a_new_computed_answer(
    make_rig: RigFactory, key_store: RedisTaskStore | None
) -> None:
    rig = await make_rig(store=key_store)
    first = await rig.client.post("/v1/tasks", json={"input": "again", "timeout_ms": 100}, headers=_key("k-exp"))
    first_id = first.json()["task_id"]
    await _end(rig.store, first_id, TaskStatus.EXPIRED, "deadline_exceeded")
    worker = await rig.worker()

    retry = await rig.client.post("/v1/inference", json={"input": "again", "timeout_ms": 5000}, headers=_key("k-exp"))

    assert retry.status_code == 200, f"the retry must be computed, not answered with the old 504: {retry.text}"
    assert retry.json()["task_id"] != first_id
    assert retry.json()["output"] == "niaga"
    assert "idempotent-replayed" not in retry.headers, "a new task is not a replay"
    assert [r.task_id for r in worker.seen if r.task_id != first_id] == [retry.json()["task_id"]]
    replay = await rig.client.post("/v1/inference", json={"input": "again"}, headers=_key("k-exp"))
    assert (replay.json()["task_id"], replay.headers.get("idempotent-replayed")) == (retry.json()["task_id"], "true")


async def test_a_retry_of_a_cancelled_task_starts_a_new_task(
    make_rig: RigFactory, key_store: RedisTaskStore | None
) -> None:
    rig = await make_rig(store=key_store)
    first = await rig.client.post("/v1/tasks", json={"input": "undo"}, headers=_key("k-can"))
    first_id = first.json()["task_id"]
    assert (await rig.client.delete(f"/v1/result/{first_id}")).json()["status"] == "cancelled"

    retry = await rig.client.post("/v1/tasks", json={"input": "undo"}, headers=_key("k-can"))

    assert retry.status_code == 202, retry.text
    assert retry.json()["task_id"] != first_id, "a cancelled task's key must not answer 409 forever"
    assert retry.json()["status"] == "queued"
    assert "idempotent-replayed" not in retry.headers
    await rig.worker()
    sync = await rig.client.post("/v1/inference", json={"input": "undo"}, headers=_key("k-can"))
    assert (sync.status_code, sync.json()["task_id"], sync.json()["output"]) == (200, retry.json()["task_id"], "odnu")


async def test_an_asynchronous_retry_of_a_task_still_queued_past_its_deadline_gets_a_new_task(
    make_rig: RigFactory, key_store: RedisTaskStore | None
) -> None:
    """No batcher is up, so the first task still reads `queued` past its deadline, and a read of it then
    ends it `expired` (``TaskReads``). The retry's 202 reads it the same way: it names a new task, as
    after any end without a computation, not the old one as `queued`, one read from `expired`."""
    clock = _WallAhead()
    rig = await make_rig(store=key_store, clock=clock)
    body = {"input": "late", "timeout_ms": 1_000}
    first = await rig.client.post("/v1/tasks", json=body, headers=_key("k-late"))
    first_id = first.json()["task_id"]
    late_ms = 1_000 + int(rig.settings.reply_recheck_s * 1_000) + 100
    assert late_ms < 1_000 + STALE_AFTER_MS, "late for a read, but the binding is not stale yet"
    clock.ahead_ms += late_ms

    retry = await rig.client.post("/v1/tasks", json=body, headers=_key("k-late"))

    assert retry.status_code == 202, retry.text
    answered = (retry.json()["task_id"] == first_id, retry.json()["status"], retry.headers.get("idempotent-replayed"))
    assert answered == (False, "queued", None), f"expected a new queued task, not a replay: {retry.json()}"
    read = await rig.client.get(f"/v1/result/{first_id}")
    assert (read.json()["status"], read.json()["error"]["code"]) == ("expired", "deadline_exceeded"), read.text
    again = await rig.client.post("/v1/tasks", json=body, headers=_key("k-late"))
    assert (again.json()["task_id"], again.headers.get("idempotent-replayed")) == (retry.json()["task_id"], "true")
    assert rig.produced() == 2, "the first request and the retry's"


async def test_a_synchronous_retry_waiting_on_a_task_that_turns_late_starts_its_own(make_rig: RigFactory) -> None:
    """No batcher takes the first task. Once it is late for a read, the waiting retry's re-read ends it
    `expired` as a poll's would, and the retry starts its own task, instead of waiting until the binding
    is stale (``STALE_AFTER_MS`` past the first task's deadline, 20 s away here)."""
    clock = _WallAhead()
    rig = await make_rig(clock=clock)
    first = await rig.client.post("/v1/tasks", json={"input": "unbatched", "timeout_ms": 20_000}, headers=_key("k-w"))
    first_id = first.json()["task_id"]
    retry = asyncio.create_task(
        rig.client.post("/v1/inference", json={"input": "unbatched", "timeout_ms": 30_000}, headers=_key("k-w"))
    )
    await eventually(lambda: first_id in rig.store._watchers, "the retry to wait for the first task")
    clock.ahead_ms += 20_000 + int(rig.settings.reply_recheck_s * 1_000) + 100

    await eventually(lambda: rig.produced() == 2, "the retry to send its own task once the first reads late")
    ended = await rig.store.get(first_id)
    assert ended is not None and ended.status is TaskStatus.EXPIRED, f"the first task ends as a poll ends it: {ended}"
    await rig.worker()
    answer = await asyncio.wait_for(retry, 10)
    assert (answer.status_code, answer.json().get("output")) == (200, "dehctabnu"), answer.text
    assert answer.json()["task_id"] != first_id


async def test_a_task_refused_by_the_bus_starts_anew_but_one_failed_in_the_model_replays(
    make_rig: RigFactory, key_store: RedisTaskStore | None
) -> None:
    rig = await make_rig(store=key_store)
    refused = await rig.client.post("/v1/tasks", json={"input": "fail: twice"}, headers=_key("k-fail"))
    await _end(rig.store, refused.json()["task_id"], TaskStatus.FAILED, "unavailable")
    worker = await rig.worker()

    computed = await rig.client.post("/v1/inference", json={"input": "fail: twice"}, headers=_key("k-fail"))
    assert computed.status_code == 502, computed.text
    assert error_of(computed)["code"] == "backend_error"
    assert error_of(computed)["task_id"] != refused.json()["task_id"], "a refused task starts anew"

    replayed = await rig.client.post("/v1/inference", json={"input": "fail: twice"}, headers=_key("k-fail"))
    assert error_of(replayed)["task_id"] == error_of(computed)["task_id"], "a model's own failure is replayed"
    assert "idempotent-replayed" not in computed.headers, "a new task's failure is not a replay"
    assert replayed.headers.get("idempotent-replayed") == "true", f"a replayed failure: {dict(replayed.headers)}"
    assert len([r for r in worker.seen if r.input == "fail: twice"]) == 2, "computed once after the refusal"


async def test_racing_retries_of_an_expired_task_share_one_new_task(
    make_rig: RigFactory, key_store: RedisTaskStore | None
) -> None:
    rig = await make_rig(store=key_store)
    first = await rig.client.post("/v1/tasks", json={"input": "race"}, headers=_key("k-race"))
    first_id = first.json()["task_id"]
    await _end(rig.store, first_id, TaskStatus.EXPIRED, "deadline_exceeded")
    worker = await rig.worker()
    worker.gate.clear()

    retries = [
        asyncio.create_task(rig.client.post("/v1/inference", json={"input": "race"}, headers=_key("k-race")))
        for _ in range(10)
    ]
    await eventually(lambda: rig.gateway.inflight == 10, "the retries to wait")
    worker.gate.set()
    answers = [await asyncio.wait_for(task, 10) for task in retries]

    assert {a.status_code for a in answers} == {200}, [a.text for a in answers]
    new_ids = {a.json()["task_id"] for a in answers}
    assert len(new_ids) == 1 and first_id not in new_ids, f"expected one new task for all, got {new_ids}"
    assert [r.task_id for r in worker.seen if r.task_id != first_id] == list(new_ids), "computed once"


class RoundTripStore(RecordingStore):
    """Each read is a round trip, as over Redis: other submits run meanwhile."""

    async def get(self, task_id: str) -> TaskState | None:
        await asyncio.sleep(0)
        return await super().get(task_id)


async def test_racing_asynchronous_retries_of_an_expired_task_each_report_the_new_task(
    make_rig: RigFactory, key_store: RedisTaskStore | None
) -> None:
    """The retry that loses the race to replace the expired task is told the winner's new task, not
    the expired one's status under the new id."""
    rig = await make_rig(store=key_store or RoundTripStore())
    first = await rig.client.post("/v1/tasks", json={"input": "race"}, headers=_key("k-race-async"))
    first_id = first.json()["task_id"]
    await _end(rig.store, first_id, TaskStatus.EXPIRED, "deadline_exceeded")

    answers = await asyncio.gather(
        *(rig.client.post("/v1/tasks", json={"input": "race"}, headers=_key("k-race-async")) for _ in range(4))
    )
    assert {a.status_code for a in answers} == {202}, [a.text for a in answers]
    bodies = [a.json() for a in answers]
    assert len({b["task_id"] for b in bodies}) == 1 and bodies[0]["task_id"] != first_id, bodies
    assert {b["status"] for b in bodies} == {"queued"}, f"a retry reported the expired task's status: {bodies}"


async def test_a_retry_waiting_on_a_task_that_expires_starts_its_own_within_its_deadline(
    make_rig: RigFactory, key_store: RedisTaskStore | None
) -> None:
    """The retry asked for more time than the first try had: it gets it."""
    rig = await make_rig(store=key_store)
    first = await rig.client.post("/v1/tasks", json={"input": "patient"}, headers=_key("k-wait"))
    first_id = first.json()["task_id"]
    retry = asyncio.create_task(
        rig.client.post("/v1/inference", json={"input": "patient", "timeout_ms": 10_000}, headers=_key("k-wait"))
    )
    await eventually(lambda: rig.gateway.inflight == 1, "the retry to wait for the first task")
    await _end(rig.store, first_id, TaskStatus.EXPIRED, "deadline_exceeded")
    await rig.worker()

    answer = await asyncio.wait_for(retry, 10)

    assert answer.status_code == 200, answer.text
    assert answer.json()["task_id"] != first_id
    assert answer.json()["output"] == "tneitap"


# over the real Redis -----------------------------------------------------------------------------


@pytest.fixture
async def redis_stores(request: pytest.FixtureRequest, names: Names) -> AsyncIterator[list[RedisTaskStore]]:
    url = request.getfixturevalue("infra").redis_url
    stores = [RedisTaskStore(url, names) for _ in range(2)]
    for store in stores:
        await store.start()
    yield stores
    for store in stores:
        await store.close()


@pytest.mark.kafka
async def test_a_retry_at_another_gateway_gets_the_first_task(
    make_rig: RigFactory, redis_stores: list[RedisTaskStore]
) -> None:
    """Two gateways share Redis and the bus; the retry lands on the other one."""
    bus = MemoryRequestBus(Partitioner(MODELS, 4))
    first_gateway = await make_rig(store=redis_stores[0], bus=bus)
    second_gateway = await make_rig(store=redis_stores[1], bus=bus)
    worker = await first_gateway.worker()
    worker.gate.clear()

    first = asyncio.create_task(
        first_gateway.client.post("/v1/inference", json={"input": "shared"}, headers=_key("k-redis"))
    )
    await eventually(lambda: first_gateway.produced() == 1, "the first request on the bus")
    retry = asyncio.create_task(
        second_gateway.client.post("/v1/inference", json={"input": "shared"}, headers=_key("k-redis"))
    )
    await eventually(lambda: second_gateway.gateway.inflight == 1, "the retry to wait")
    worker.gate.set()
    answers = [await asyncio.wait_for(task, 20) for task in (first, retry)]

    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert answers[0].json()["task_id"] == answers[1].json()["task_id"]
    assert answers[1].json()["output"] == "derahs"
    assert answers[1].headers["idempotent-replayed"] == "true"
    assert len(worker.seen) == 1, "one computation for both"
    again = await second_gateway.client.post("/v1/tasks", json={"input": "other"}, headers=_key("k-redis"))
    assert again.status_code == 422


# a key whose task was lost -------------------------------------------------------------------------


async def test_a_key_bound_to_a_task_past_its_deadline_that_was_never_stored_names_a_new_task(
    make_rig: RigFactory, key_store: RedisTaskStore | None
) -> None:
    """The first submit bound its key, then neither its request nor its record got anywhere (the
    store failed over, the gateway died): once that task's deadline has passed, it never will run."""
    rig = await make_rig(store=key_store)
    store = key_store if key_store is not None else rig.store
    await rig.worker()
    fingerprint = idempotency.fingerprint("gone", rig.settings.default_model)
    past = now_ms() - STALE_AFTER_MS - 1_000
    for key in ("k-gone-sync", "k-gone-async"):
        await store.claim_key(idempotency.ANONYMOUS_SCOPE, key, f"never-{key}", fingerprint, past)

    sync = await rig.client.post("/v1/inference", json={"input": "gone"}, headers=_key("k-gone-sync"))
    queued = await rig.client.post("/v1/tasks", json={"input": "gone"}, headers=_key("k-gone-async"))

    assert sync.status_code == 200, sync.text
    assert sync.json()["task_id"] != "never-k-gone-sync"
    assert sync.json()["output"] == "enog"
    assert queued.status_code == 202, queued.text
    assert queued.json()["task_id"] != "never-k-gone-async"
    again = await rig.client.post("/v1/inference", json={"input": "gone"}, headers=_key("k-gone-sync"))
    assert again.json()["task_id"] == sync.json()["task_id"], "the new task is replayed from then on"


async def test_a_synchronous_retry_of_a_bound_task_that_was_never_stored_sends_it_and_answers_at_once(
    make_rig: RigFactory, key_store: RedisTaskStore | None
) -> None:
    """Not waiting until the bound task is stale: nothing would ever send it."""
    rig = await make_rig(store=key_store)
    store = key_store if key_store is not None else rig.store
    await rig.worker()
    fingerprint = idempotency.fingerprint("late", rig.settings.default_model)
    far = now_ms() + 60_000
    await store.claim_key(idempotency.ANONYMOUS_SCOPE, "k-late", "never-stored", fingerprint, far)

    answer = await rig.client.post(
        "/v1/inference", json={"input": "late", "timeout_ms": 20_000}, headers=_key("k-late"), timeout=30
    )

    assert answer.status_code == 200, answer.text
    assert (answer.json()["task_id"], answer.json()["output"]) == ("never-stored", "etal")
    assert answer.headers["idempotent-replayed"] == "true"


@pytest.mark.parametrize("left_ms", [-500, 300])
async def test_a_retry_of_a_lost_task_at_its_deadline_gets_a_new_task_with_its_own_timeout(
    make_rig: RigFactory, key_store: RedisTaskStore | None, left_ms: int
) -> None:
    """The first try's client timed out and retries around the lost task's deadline, before the
    binding is stale: sending that task again with what is left of its time would expire on the way
    (a 504 naming a timeout_ms the caller never sent)."""
    rig = await make_rig(store=key_store)
    store = key_store if key_store is not None else rig.store
    await rig.worker()
    fingerprint = idempotency.fingerprint("lost", rig.settings.default_model)
    key = f"k-lost{left_ms}"
    await store.claim_key(idempotency.ANONYMOUS_SCOPE, key, f"lost{left_ms}", fingerprint, now_ms() + left_ms)

    sync = await rig.client.post("/v1/inference", json={"input": "lost"}, headers=_key(key), timeout=30)
    queued = await rig.client.post("/v1/tasks", json={"input": "lost"}, headers=_key(key))

    assert sync.status_code == 200, sync.text
    assert sync.json()["task_id"] != f"lost{left_ms}" and sync.json()["output"] == "tsol"
    lost = await store.get(f"lost{left_ms}")
    assert lost is not None and lost.status is TaskStatus.EXPIRED, "the lost task ends, so nothing answers it later"
    assert lost.error_message is not None and "timeout_ms=" not in lost.error_message, (
        f"the lost task's end must not name a timeout_ms its caller never sent: {lost.error_message!r}"
    )
    assert "Idempotency-Key" in lost.error_message, f"the end says a retry starts anew: {lost.error_message!r}"
    assert queued.status_code == 202 and queued.json()["task_id"] == sync.json()["task_id"], queued.text


class _StoreDownForKeys(RecordingStore):
    """The memory store whose writes fail while ``down`` (a store that went away mid-submit)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    async def release_key(self, scope: str, key: str, task_id: str) -> None:
        if self.down:
            raise TransportError("store unreachable")
        await super().release_key(scope, key, task_id)

    async def apply(self, updates: Sequence[TaskState], *, counted: bool = True) -> list[bool]:
        if self.down:
            raise TransportError("store unreachable")
        return await super().apply(updates, counted=counted)

    async def cancel(
        self, task_id: str, reason_code: str, message: str, status: TaskStatus = TaskStatus.CANCELLED
    ) -> TaskState | None:
        if self.down:
            raise TransportError("store unreachable")
        return await super().cancel(task_id, reason_code, message, status)


class _RefusesOnce:
    """The bus's producer, refusing the first send (the broker was away for it)."""

    def __init__(self, bus: MemoryRequestBus) -> None:
        self.inner = bus.producer()
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def send(self, request: InferenceRequest) -> None:
        if not self.refused:
            self.refused += 1
            raise TransportError("broker unreachable")
        await self.inner.send(request)


async def test_a_key_whose_task_could_not_be_sent_or_released_is_freed_once_the_store_is_back() -> None:
    """The bus refused the request and the store was down when the gateway unbound the key: the
    gateway ends that task ``failed`` (unavailable) and unbinds the key once the store is back, so a
    retry waiting for it gets its own answer at once rather than a 504."""
    settings = GatewaySettings(models=MODELS, default_model="sim")
    bus = MemoryRequestBus(Partitioner(settings.models, 4))
    store = _StoreDownForKeys()
    gateway = Gateway(settings, _RefusesOnce(bus), store)
    await gateway.start()
    worker = FakeWorker(bus, store)
    await worker.start()
    try:
        store.down = True
        with pytest.raises(Unavailable) as refused:
            await gateway.submit("lost", None, 20_000, True, idempotency_key="k-unsent")
        unsent = refused.value.task_id
        assert unsent is not None
        retry = asyncio.create_task(gateway.submit("lost", None, 20_000, True, idempotency_key="k-unsent"))
        await eventually(lambda: gateway.inflight == 1, "the retry to wait for the unsent task")
        assert not retry.done()
        store.down = False

        answer = await asyncio.wait_for(retry, 10)

        assert (answer.output, answer.replayed) == ("tsol", False)
        assert answer.task_id != unsent
        ended = await store.get(unsent)
        assert ended is not None and (ended.status, ended.error_code) == (TaskStatus.FAILED, "unavailable")
        assert [r.input for r in worker.seen] == ["lost"], "only the retry's task reached the bus"
    finally:
        await worker.close()
        await gateway.close()


async def test_a_key_that_cannot_be_released_as_the_gateway_closes_is_left_to_go_stale() -> None:
    """A submit whose request never reached the bus, ending after the gateway closed, with the store
    down: nothing is left to end its task later, and its caller gets its own error, not a 500."""
    store, clock = _StoreDownForKeys(), SystemClock()
    reads = TaskReads(GatewaySettings(models=MODELS, default_model="sim"), store, clock)
    keys = KeyedReplay(store, clock, reads, recheck_s=1.0, name="gw")
    await keys.start()
    await keys.close()
    store.down = True
    await keys.release("scope", "k", "t1", "sim", None, asyncio.get_running_loop().time() + 5)
    assert not keys.alive


class _WallAhead(SystemClock):
    """The real clocks, with wall time the test moves forward: seconds passing, as deadlines see them."""

    def __init__(self) -> None:
        self.ahead_ms = 0

    def wall_ms(self) -> int:
        return super().wall_ms() + self.ahead_ms


async def test_a_retry_that_started_its_own_task_binds_the_key_for_that_tasks_whole_deadline() -> None:
    """A retry waits 9 s for the key's task, which then expires: the retry's own task, sent then with
    its full timeout, keeps the key until its deadline, so a later retry finds it instead of
    taking it for a lost one (``STALE_AFTER_MS`` past the binding's deadline) and sending a third."""
    settings = GatewaySettings(models=MODELS, default_model="sim")
    bus = MemoryRequestBus(Partitioner(settings.models, 4))
    store, clock = RecordingStore(), _WallAhead()
    gateway = Gateway(settings, bus.producer(), store, clock)
    await gateway.start()
    try:
        first = await gateway.submit("x", None, 10_000, False, idempotency_key="k")
        retry = asyncio.create_task(gateway.submit("x", None, 10_000, True, idempotency_key="k"))
        await eventually(lambda: first.task_id in store._watchers, "the retry to wait for the first task")
        clock.ahead_ms += 9_000
        stored = await store.get(first.task_id)
        assert stored is not None
        await store.apply([replace(stored, status=TaskStatus.EXPIRED, updated_at_ms=clock.wall_ms())])
        await eventually(lambda: sum(map(len, bus.log.records)) == 2, "the retry to send its own task")
        own = [r for records in bus.log.records for r in records][-1]
        clock.ahead_ms += STALE_AFTER_MS + 1_500  # past the deadline the key had when the retry began
        assert own.deadline_ms > clock.wall_ms(), "the retry's own task is still live"
        again = await gateway.submit("x", None, 10_000, False, idempotency_key="k")
        assert again.task_id == own.task_id, "the key still names the live task"
        assert sum(map(len, bus.log.records)) == 2, "nothing was sent a third time"
    finally:
        retry.cancel()
        await asyncio.gather(retry, return_exceptions=True)
        await gateway.close()


class InputsFullStore(RecordingStore):
    """The embedded store once a model's waiting inputs fill its share of the memory budget."""

    inputs_full = False

    def full(self, model: str) -> str | None:
        return f"model {model!r} has 64 MiB of inputs waiting for a worker" if self.inputs_full else None


async def test_a_retry_is_answered_while_the_models_waiting_inputs_fill_its_memory(make_rig: RigFactory) -> None:
    """As however full its queue is: a retry of a task adds no input, so the embedded store's memory
    budget refuses only a new task (and unbinds its key, as nothing was queued)."""
    store = InputsFullStore()
    rig = await make_rig(store=store)
    await rig.worker()
    first = await rig.client.post("/v1/inference", json={"input": "once"}, headers=_key("k-full"))
    assert first.status_code == 200, first.text
    store.inputs_full = True

    retry = await rig.client.post("/v1/inference", json={"input": "once"}, headers=_key("k-full"))
    polled = await rig.client.post("/v1/tasks", json={"input": "once"}, headers=_key("k-full"))
    new = await rig.client.post("/v1/inference", json={"input": "new"}, headers=_key("k-new"))

    assert retry.status_code == 200 and retry.json()["output"] == "ecno", retry.text
    assert polled.status_code == 202 and polled.json()["task_id"] == first.json()["task_id"], polled.text
    assert new.status_code == 503 and error_of(new)["code"] == "overloaded", new.text
    store.inputs_full = False
    again = await rig.client.post("/v1/inference", json={"input": "new"}, headers=_key("k-new"))
    assert again.status_code == 200 and "idempotent-replayed" not in again.headers, "the refusal unbound the key"
    assert rig.produced() == 2, "only the first task and the new one after the refusal were queued"
