"""Request collapsing and the result cache at the gateway: shared computations, scoping, failures, TTL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gateway.answers.replies import Replies
from gateway.clock import SystemClock
from gateway.edge.auth import digest_of, owner_of
from gateway.errors import NotReady
from gateway.publisher import TaskPublisher
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from gateway.sharing.collapsing import Collapser
from gateway.submission import Submission
from schemas.records import TaskState, TaskStatus
from schemas.wire import Names
from telemetry.metrics import CACHE_BYPASSED, CACHE_HITS, COLLAPSED
from tests.support.eventually import eventually
from tests.support.fake_clock import FakeClock
from tests.support.gateway_rig import (
    MODELS,
    RecordingStore,
    Rig,
    RigFactory,
    StalledStore,
    deadline_passed_on,
    error_of,
)
from tests.support.metrics import tasks_ended
from transport.memory.cache import MemoryResultCache
from transport.memory.limits import MemoryRateLimiter
from transport.memory.requests import MemoryRequestBus
from transport.ports import TransportError
from transport.redis.cache import RedisResultCache
from transport.redis.store import RedisTaskStore
from transport.routing import Partitioner

pytestmark = pytest.mark.timeout(60)

KEY_A = "alpha-key-0123456789"
KEY_B = "bravo-key-9876543210"
SHARING: dict[str, Any] = {"deterministic_models": ("sim",)}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def count(metric: Any, model: str = "sim") -> float:
    value: float = metric.labels(model=model)._value.get()
    return value


async def infer(rig: Rig, text: str, headers: dict[str, str] | None = None, model: str = "sim") -> httpx.Response:
    return await rig.client.post("/v1/inference", json={"input": text, "model": model}, headers=headers)


async def infer_at(rig: Rig, text: str, priority: str) -> httpx.Response:
    return await rig.client.post("/v1/inference", json={"input": text, "priority": priority})


def collapsed_callers(rig: Rig) -> list[str]:
    """Task ids of the synchronous callers whose records the collapser wrote (queued, reply address set)."""
    return [s.task_id for s in rig.store.created if s.status is TaskStatus.QUEUED and not s.task_id.startswith("c-")]


async def test_identical_requests_in_flight_share_one_computation(make_rig: RigFactory) -> None:
    rig = await make_rig(**SHARING)
    worker = await rig.worker()
    worker.gate.clear()
    before = count(COLLAPSED)
    calls = [asyncio.create_task(infer(rig, "trending")) for _ in range(5)]
    other = asyncio.create_task(infer(rig, "niche"))
    await eventually(lambda: len(collapsed_callers(rig)) == 6, "six callers recorded")
    worker.gate.set()
    answers = [(await call).json() for call in calls]
    assert {a["output"] for a in answers} == {"gnidnert"}, answers
    assert len({a["task_id"] for a in answers}) == 5, "each caller keeps its own task id"
    assert (await other).json()["output"] == "ehcin"
    assert sorted(r.input for r in worker.seen) == ["niche", "trending"], "one computation per distinct input"
    assert count(COLLAPSED) - before == 4
    for answer in answers:
        polled = (await rig.client.get(f"/v1/result/{answer['task_id']}")).json()
        assert (polled["status"], polled["output"]) == ("completed", "gnidnert"), polled


async def test_collapsed_callers_count_one_end_their_computations(make_rig: RigFactory) -> None:
    """``batchwire_tasks_ended`` counts the computation's end once, where it is written; its copies
    onto the callers' tasks are not counted again."""
    rig = await make_rig(**SHARING)
    worker = await rig.worker()
    worker.gate.clear()
    before = tasks_ended("completed")
    calls = [asyncio.create_task(infer(rig, "thrice")) for _ in range(3)]
    await eventually(lambda: len(collapsed_callers(rig)) == 3, "three callers recorded")
    worker.gate.set()
    assert [(await call).status_code for call in calls] == [200, 200, 200]
    assert rig.produced() == 1, "one computation"
    counted = tasks_ended("completed") - before
    assert counted == 1, f"the computation's end, counted once; counted {counted}"


async def test_every_answer_matches_its_own_input(make_rig: RigFactory) -> None:
    rig = await make_rig(**SHARING)
    await rig.worker()
    texts = [f"input-{i % 7}" for i in range(60)]
    responses = await asyncio.gather(*(infer(rig, text) for text in texts))
    for text, response in zip(texts, responses, strict=True):
        assert response.status_code == 200, response.text
        assert response.json()["output"] == text[::-1], f"{text!r} got {response.json()}"


async def test_a_non_deterministic_model_is_neither_collapsed_nor_cached(make_rig: RigFactory) -> None:
    rig = await make_rig(**SHARING, cache=MemoryResultCache(), cache_ttl_s=60.0)
    worker = await rig.worker()
    worker.gate.clear()
    calls = [asyncio.create_task(infer(rig, "same", model="echo")) for _ in range(3)]
    await eventually(lambda: rig.produced() == 3, "three requests on the bus")
    worker.gate.set()
    assert [(await call).status_code for call in calls] == [200, 200, 200]
    assert (await infer(rig, "same", model="echo")).status_code == 200
    assert len(worker.seen) == 4, "echo is not deterministic: every request runs"


async def test_delete_of_one_collapsed_caller_cancels_only_that_caller(make_rig: RigFactory) -> None:
    rig = await make_rig(**SHARING)
    worker = await rig.worker()
    worker.gate.clear()
    first = asyncio.create_task(infer(rig, "shared"))
    await eventually(lambda: len(collapsed_callers(rig)) == 1, "the first caller recorded")
    second = asyncio.create_task(infer(rig, "shared"))
    await eventually(lambda: len(collapsed_callers(rig)) == 2, "the second caller recorded")
    first_id = collapsed_callers(rig)[0]  # the caller that started the computation leaves

    deleted = await rig.client.delete(f"/v1/result/{first_id}")

    assert deleted.status_code == 200 and deleted.json()["status"] == "cancelled", deleted.text
    cancelled = await first
    assert (cancelled.status_code, error_of(cancelled)["code"]) == (409, "task_cancelled"), cancelled.text
    worker.gate.set()
    answer = await second
    assert answer.status_code == 200 and answer.json()["output"] == "derahs", answer.text
    assert len(worker.seen) == 1, "the computation ran on for the caller still waiting"
    polled = (await rig.client.get(f"/v1/result/{first_id}")).json()
    assert polled["status"] == "cancelled", "the answer is not written over the cancelled caller"


async def test_the_last_caller_leaving_cancels_the_computation(make_rig: RigFactory) -> None:
    rig = await make_rig(**SHARING)
    call = asyncio.create_task(infer(rig, "nobody waits"))  # no worker: it stays queued
    await eventually(lambda: len(collapsed_callers(rig)) == 1 and rig.produced() == 1, "the caller and its request")
    computation = rig.only_request().task_id
    async with rig.store.watch(computation) as changes:
        assert (await rig.client.delete(f"/v1/result/{collapsed_callers(rig)[0]}")).status_code == 200
        assert (await call).status_code == 409
        async with asyncio.timeout(10):
            async for change in changes:
                if change.status is TaskStatus.CANCELLED:
                    break
    state = await rig.store.get(computation)
    assert state is not None and state.status is TaskStatus.CANCELLED, state


async def test_a_caller_whose_shared_computation_expires_first_is_told_what_to_change() -> None:
    """A caller that joined a computation ending a little before its own deadline (``JOIN_SLACK``) gets
    the computation's expiry: its message names the timeout that ran out and what to send."""
    store = RecordingStore()
    clock = SystemClock()
    replies = Replies(store, clock, first_check_s=1.0, name="g1")
    publisher = TaskPublisher(MemoryRequestBus(Partitioner(MODELS, 4)).producer(), store, clock, write_timeout_s=1.0)
    collapser = Collapser(store, publisher, replies, clock, gateway_id="g1")  # no worker: the computation expires
    await replies.start()
    await collapser.start()
    try:
        now = asyncio.get_running_loop().time()

        def sent(task_id: str, after_s: float) -> Submission:  # timeout_ms=2000, sent ``after_s`` after the first
            return Submission(task_id, "late", "sim", 2_000, now + after_s + 2.0, clock.monotonic(), None)

        first = asyncio.create_task(collapser.answer("key", sent("first", 0.0), None))
        await eventually(lambda: collapser.callers("key") == {"first"}, "the first caller's computation")
        joined = await collapser.answer("key", sent("second", 0.18), None)  # within a tenth of its timeout
        await asyncio.gather(first, return_exceptions=True)  # its deadline is the computation's: either answers it
    finally:
        await collapser.close()
        await replies.close(lambda: NotReady("closing"))
    assert (joined.task_id, joined.status, joined.error_code) == ("second", TaskStatus.EXPIRED, "deadline_exceeded")
    message = joined.error_message or ""
    assert "timeout_ms=2000" in message and "longer timeout_ms" in message, message


async def test_a_request_never_joins_a_computation_of_a_lower_tier(make_rig: RigFactory) -> None:
    """A high-priority request that joined a low one's computation would wait at the low tier, behind
    work its admission did not count: it starts one at its own tier, which a later low request joins."""
    rig = await make_rig(**SHARING)
    worker = await rig.worker()
    worker.gate.clear()
    low = asyncio.create_task(infer_at(rig, "popular", "low"))
    await eventually(lambda: rig.produced() == 1, "the low request's computation on the bus")
    high = asyncio.create_task(infer_at(rig, "popular", "high"))
    await eventually(lambda: len(collapsed_callers(rig)) == 2, "the high caller recorded")
    later = asyncio.create_task(infer_at(rig, "popular", "low"))
    await eventually(lambda: len(collapsed_callers(rig)) == 3, "the later low caller recorded")
    worker.gate.set()
    answers = [await call for call in (low, high, later)]

    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    sent = [request.priority.value for request in worker.seen]
    assert sorted(sent) == ["high", "low"], f"expected a high computation beside the low one, sent {sent}"


async def test_a_computations_answer_also_answers_an_identical_one_still_running(make_rig: RigFactory) -> None:
    """A high request starts a computation of its own beside a low one for the same input (it may not wait
    at the low tier); whichever ends first answers the callers of both, and the other, left with no caller,
    is cancelled: the low caller waited on for its own, behind the low queue, with the answer in hand."""

    async def ignore(_: frozenset[int]) -> None:
        return None

    rig = await make_rig(**SHARING)
    consumer = rig.bus.consumer()  # the worker: it answers the high computation alone
    await consumer.start(ignore, ignore)
    low = asyncio.create_task(infer_at(rig, "popular", "low"))
    await eventually(lambda: rig.produced() == 1, "the low request's computation on the bus")
    high = asyncio.create_task(infer_at(rig, "popular", "high"))
    await eventually(lambda: rig.produced() == 2, "the high request's computation on the bus")
    sent: list[Any] = []
    while len(sent) < 2:
        sent += [record.value for record in await consumer.fetch(timeout_s=1.0, max_records=10)]
    [low_computation] = [request for request in sent if request.priority.value == "low"]
    [high_computation] = [request for request in sent if request.priority.value == "high"]
    answer = TaskState(
        high_computation.task_id,
        TaskStatus.COMPLETED,
        "sim",
        high_computation.enqueued_at_ms,
        high_computation.enqueued_at_ms,
        output="ralupop",
        reply_to=high_computation.reply_to,
    )
    await rig.store.apply([answer])

    answers = await asyncio.wait_for(asyncio.gather(high, low), 10)
    assert [(a.status_code, a.json().get("output")) for a in answers] == [(200, "ralupop")] * 2, [
        a.text for a in answers
    ]
    state = await rig.store.get(low_computation.task_id)  # its last caller left before being answered
    assert state is not None and state.status is TaskStatus.CANCELLED, state


async def test_a_cache_hit_answers_without_the_bus_in_every_shape(make_rig: RigFactory) -> None:
    rig = await make_rig(**SHARING, cache=MemoryResultCache(), cache_ttl_s=60.0)
    await rig.worker()
    computed = await infer(rig, "hello")
    assert computed.json()["output"] == "olleh"
    hits = count(CACHE_HITS)

    cached = await infer(rig, "hello")
    accepted = await rig.client.post("/v1/tasks", json={"input": "hello"})

    assert rig.produced() == 1, "both hits answered without the bus"
    assert count(CACHE_HITS) - hits == 2
    body = cached.json()
    assert set(body) == set(computed.json()) and body["output"] == "olleh", body
    assert body["task_id"] != computed.json()["task_id"], "a hit gets a task id of its own"
    assert accepted.status_code == 202 and accepted.json()["status"] == "completed", accepted.text
    spec = (await rig.client.get("/openapi.json")).json()
    documented = spec["components"]["schemas"]["TaskAccepted"]["properties"]["status"]["description"]
    assert "`completed` for one answered from the result cache" in documented, f"the 202 documents {documented!r}"
    polled = (await rig.client.get(accepted.json()["result_url"])).json()
    assert (polled["status"], polled["output"]) == ("completed", "olleh"), polled
    async with rig.client.stream("GET", accepted.json()["events_url"]) as events:
        data = [line async for line in events.aiter_lines() if line.startswith("data:")]
    assert len(data) == 1 and '"completed"' in data[0] and "olleh" in data[0], data


class FillingStore(RecordingStore):
    """A store that can turn full (Redis over its maxmemory): it then refuses every write."""

    filled = False
    failed_creates = 0

    def refuses_writes(self) -> str | None:
        return "the result store is full" if self.filled else None

    async def create(self, state: TaskState) -> bool:
        if self.filled:
            self.failed_creates += 1
            raise TransportError("OOM command not allowed when used memory > 'maxmemory'")
        return await super().create(state)


async def hello_cached(make_rig: RigFactory, store: RecordingStore) -> Rig:
    """A rig over ``store`` whose result cache holds the answer to "hello"."""
    rig = await make_rig(**SHARING, store=store, cache=MemoryResultCache(), cache_ttl_s=60.0)
    await rig.worker()
    assert (await infer(rig, "hello")).json()["output"] == "olleh"
    return rig


async def test_a_full_store_still_answers_a_synchronous_cache_hit(make_rig: RigFactory) -> None:
    """A cached answer needs no room in the store: a full one refuses only what must be stored."""
    store = FillingStore()
    rig = await hello_cached(make_rig, store)
    store.filled = True

    cached = await infer(rig, "hello")
    uncached = await infer(rig, "world")
    polled_hit = await rig.client.post("/v1/tasks", json={"input": "hello"})

    assert cached.status_code == 200 and cached.json()["output"] == "olleh", cached.text
    for refused in (uncached, polled_hit):  # its answer, or the hit's record to poll, must be stored
        assert refused.status_code == 503 and "retry-after" in refused.headers, refused.text
        assert error_of(refused)["code"] == "unavailable", refused.text
    assert rig.produced() == 1, "nothing was queued while the store was full"
    assert store.failed_creates == 0, "a write was tried on the full store"
    assert rig.gateway.inflight == 0


async def test_a_synchronous_request_refused_by_a_full_store_gives_its_rate_limit_token_back(
    make_rig: RigFactory,
) -> None:
    """As one refused before admission takes none: with a result cache, a full store's refusal waits
    until the cache has no answer, after the client's token was taken."""
    store = FillingStore()
    limits: dict[str, Any] = {"rate_limit_per_s": 0.001, "rate_limit_burst": 2}
    cache = MemoryResultCache()
    rig = await make_rig(
        **SHARING, **limits, store=store, cache=cache, cache_ttl_s=60.0, limiter=MemoryRateLimiter(0.001, 2)
    )
    await rig.worker()
    store.filled = True
    for text in ("a", "b", "c"):
        refused = await infer(rig, text)
        assert refused.status_code == 503 and error_of(refused)["code"] == "unavailable", refused.text
    store.filled = False
    answered = await infer(rig, "hello")
    assert answered.status_code == 200, f"the refusals kept the client's tokens: {answered.text}"


class InputsFullStore(RecordingStore):
    """The embedded store once a model's waiting inputs fill its share of the memory budget."""

    inputs_full = False

    def full(self, model: str) -> str | None:
        return f"model {model!r} has 64 MiB of inputs waiting for a worker" if self.inputs_full else None


async def test_a_model_whose_waiting_inputs_fill_its_memory_still_answers_from_the_cache(make_rig: RigFactory) -> None:
    """A model's share of the embedded memory full of waiting inputs refuses what would wait with them,
    as its queue's checks do; a cache hit adds no input, so it is answered, synchronous or not."""
    store = InputsFullStore()
    rig = await hello_cached(make_rig, store)
    store.inputs_full = True

    cached = await infer(rig, "hello")
    polled_hit = await rig.client.post("/v1/tasks", json={"input": "hello"})
    uncached = await infer(rig, "world")

    assert cached.status_code == 200 and cached.json()["output"] == "olleh", cached.text
    assert polled_hit.status_code == 202 and polled_hit.json()["status"] == "completed", polled_hit.text
    assert uncached.status_code == 503 and error_of(uncached)["code"] == "overloaded", uncached.text
    assert rig.produced() == 1, "nothing was queued while the model's inputs filled its memory"


async def test_a_failed_computation_is_never_cached(make_rig: RigFactory) -> None:
    rig = await make_rig(**SHARING, cache=MemoryResultCache(), cache_ttl_s=60.0)
    worker = await rig.worker()
    for _ in range(2):
        failed = await infer(rig, "fail:boom")
        assert error_of(failed)["code"] == "backend_error", failed.text
    assert len(worker.seen) == 2, "the second request ran again: the failure was not kept"


async def test_a_cached_answer_expires_after_its_ttl(make_rig: RigFactory) -> None:
    clock = FakeClock()
    rig = await make_rig(**SHARING, cache=MemoryResultCache(clock=clock), cache_ttl_s=30.0)
    worker = await rig.worker()
    await infer(rig, "abc")
    clock.advance(29.0)
    assert (await infer(rig, "abc")).json()["output"] == "cba"
    assert len(worker.seen) == 1, "within the TTL: a hit"
    clock.advance(2.0)
    assert (await infer(rig, "abc")).json()["output"] == "cba"
    assert len(worker.seen) == 2, "past the TTL: computed again"


async def test_tenants_never_share_answers_unless_the_model_is_public(make_rig: RigFactory) -> None:
    keys = (digest_of(KEY_A), digest_of(KEY_B))
    rig = await make_rig(**SHARING, api_keys=keys, cache=MemoryResultCache(), cache_ttl_s=60.0)
    worker = await rig.worker()
    worker.gate.clear()
    a = asyncio.create_task(infer(rig, "secret", bearer(KEY_A)))
    b = asyncio.create_task(infer(rig, "secret", bearer(KEY_B)))
    await eventually(lambda: rig.produced() == 2, "one computation per tenant, none collapsed across them")
    worker.gate.set()
    assert (await a).json()["output"] == (await b).json()["output"] == "terces"
    assert (await infer(rig, "secret", bearer(KEY_B))).status_code == 200
    assert len(worker.seen) == 2, "B's second request is B's own cache hit"
    assert (await infer(rig, "other", bearer(KEY_A))).status_code == 200
    assert (await infer(rig, "other", bearer(KEY_B))).status_code == 200
    assert len(worker.seen) == 4, "A's cached answer is never B's"


async def test_a_public_models_answers_are_shared_by_every_key(make_rig: RigFactory) -> None:
    keys = (digest_of(KEY_A), digest_of(KEY_B))
    rig = await make_rig(**SHARING, public_models=("sim",), api_keys=keys, cache=MemoryResultCache(), cache_ttl_s=60.0)
    worker = await rig.worker()
    assert (await infer(rig, "news", bearer(KEY_A))).json()["output"] == "swen"
    hit = await infer(rig, "news", bearer(KEY_B))
    assert hit.json()["output"] == "swen" and len(worker.seen) == 1, "B gets the public answer A's request computed"
    owned = (await rig.client.get(f"/v1/result/{hit.json()['task_id']}", headers=bearer(KEY_A))).status_code
    assert owned == 404, "the hit's task is B's own"


class FirstCreateFails(RecordingStore):
    """A store whose first ``create`` of a caller's record fails (a Redis blip); later writes work."""

    failed = False

    async def create(self, state: TaskState) -> bool:
        if not self.failed and not state.task_id.startswith("c-"):
            self.failed = True
            raise TransportError("connection reset")
        return await super().create(state)


async def test_a_collapsed_callers_task_stays_its_own_when_its_queued_record_could_not_be_written(
    make_rig: RigFactory,
) -> None:
    """The caller's end, copied from the computation, is then its task's first write: it carries the
    caller's owner, so the caller's key reads it (another key still gets 404)."""
    keys = (digest_of(KEY_A), digest_of(KEY_B))
    store = FirstCreateFails()
    rig = await make_rig(**SHARING, store=store, api_keys=keys)
    await rig.worker()
    answer = await infer(rig, "blip", bearer(KEY_A))
    assert answer.status_code == 200 and store.failed, answer.text
    task_id = answer.json()["task_id"]
    own = await rig.client.get(f"/v1/result/{task_id}", headers=bearer(KEY_A))
    assert (own.status_code, own.json().get("output")) == (200, "pilb"), f"the caller's own poll got {own.text}"
    other = await rig.client.get(f"/v1/result/{task_id}", headers=bearer(KEY_B))
    assert other.status_code == 404, other.text


class DownCache:
    """A cache whose store is down: every call raises, as a Redis cache does then."""

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def get(self, key: str) -> str | None:
        raise TransportError("redis is down")

    async def put(self, key: str, output: str, ttl_s: float) -> None:
        raise TransportError("redis is down")


async def test_a_collapsed_caller_on_a_store_that_does_not_answer_gets_its_504_within_a_clients_grace(
    make_rig: RigFactory,
) -> None:
    """A shared request's deadline passes while the store does not answer (its record, the end's read,
    its expired end, the computation's cancel all wait on it): the 504 comes within the shipped
    client's grace of the deadline (``batchwire.client.GRACE_S``), and its end lands once it answers."""
    store = StalledStore()
    rig = await make_rig(store=store, **SHARING)  # no worker: nobody answers
    task_id = await deadline_passed_on(rig, "/v1/inference", "shared", 0.3)
    store.back.set()
    await eventually(
        lambda: any(s.task_id == task_id and s.status is TaskStatus.EXPIRED for s in store.applied),
        "the caller's expired end to be written",
    )


async def test_a_cache_that_fails_is_bypassed(make_rig: RigFactory) -> None:
    rig = await make_rig(**SHARING, cache=DownCache(), cache_ttl_s=60.0)
    worker = await rig.worker()
    bypassed = count(CACHE_BYPASSED)
    for _ in range(2):
        answer = await infer(rig, "xyz")
        assert answer.status_code == 200 and answer.json()["output"] == "zyx", answer.text
    assert len(worker.seen) == 2
    assert count(CACHE_BYPASSED) - bypassed == 4, "two reads and two writes bypassed"


class HeldWriteCache(MemoryResultCache):
    """A cache whose writes wait for ``release``: a slow Redis, up to its half-second timeout."""

    def __init__(self) -> None:
        super().__init__()
        self.writing = asyncio.Event()
        self.release = asyncio.Event()

    async def put(self, key: str, output: str, ttl_s: float) -> None:
        self.writing.set()
        await self.release.wait()
        await super().put(key, output, ttl_s)


async def test_collapsed_callers_are_answered_without_waiting_for_the_cache_write(make_rig: RigFactory) -> None:
    """The cache is bypassed, never failed on: a caller whose computation ended holds its answer, so a
    slow cache write (kept for the next identical request) neither delays it nor runs it past its
    deadline into a 504."""
    cache = HeldWriteCache()
    rig = await make_rig(**SHARING, cache=cache, cache_ttl_s=60.0)
    await rig.worker()
    call = asyncio.create_task(rig.client.post("/v1/inference", json={"input": "slow cache", "timeout_ms": 3_000}))
    try:
        await asyncio.wait_for(cache.writing.wait(), 10)
        answer = await call
    finally:
        cache.release.set()
    assert answer.status_code == 200 and answer.json()["output"] == "ehcac wols", answer.text
    await eventually(lambda: len(cache) == 1, "the answer kept once the write went through")
    assert (await infer(rig, "slow cache")).status_code == 200 and rig.produced() == 1, "the next one is a hit"


class HeldCache(MemoryResultCache):
    """A cache whose reads wait for ``release``: a round trip in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = False
        self.release = asyncio.Event()

    async def get(self, key: str) -> str | None:
        self.reading = True
        await self.release.wait()
        return None


async def test_a_shared_submit_that_goes_on_after_the_gateway_closed_is_refused_not_ready() -> None:
    """It was reading the cache as the gateway closed: it starts no computation (the collapser is
    closed) and is answered 503 ``not_ready``, as every caller the closing gateway held."""
    settings = GatewaySettings(models=MODELS, default_model="sim", cache_ttl_s=60.0, **SHARING)
    cache = HeldCache()
    gateway = Gateway(settings, MemoryRequestBus(Partitioner(MODELS, 4)).producer(), RecordingStore(), cache=cache)
    await gateway.start()
    submit = asyncio.create_task(gateway.submit("same", None, 5_000, True))
    await eventually(lambda: cache.reading, "the submit to read the cache")
    await gateway.close()
    cache.release.set()
    with pytest.raises(NotReady):
        await asyncio.wait_for(submit, 5)
    assert gateway.waiting == 0, "no waiter is left behind"


async def test_a_gateway_that_closes_under_collapsed_computations_refuses_their_callers_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A shutdown is no failure of the computations it cuts short: each caller is answered 503
    ``not_ready`` and nothing is logged as a computation that failed."""
    settings = GatewaySettings(models=MODELS, default_model="sim", **SHARING)
    gateway = Gateway(settings, MemoryRequestBus(Partitioner(MODELS, 4)).producer(), RecordingStore())
    await gateway.start()
    submits = [asyncio.create_task(gateway.submit(text, None, 5_000, True)) for text in ("a", "a", "b")]
    await eventually(lambda: gateway.waiting == 5, "three callers and two computations held")
    await gateway.close()
    for submit in submits:
        with pytest.raises(NotReady):
            await asyncio.wait_for(submit, 5)
    assert "collapsed computation" not in caplog.text, caplog.text


# over the real Redis ------------------------------------------------------------------------------


@pytest.fixture
async def redis_parts(request: pytest.FixtureRequest, names: Names) -> AsyncIterator[tuple[RedisTaskStore, str]]:
    url = request.getfixturevalue("infra").redis_url
    store = RedisTaskStore(url, names)
    await store.start()
    yield store, url
    await store.close()


@pytest.mark.kafka
async def test_gateways_share_the_redis_cache_and_scope_it_per_key(
    make_rig: RigFactory, redis_parts: tuple[RedisTaskStore, str], names: Names
) -> None:
    store, url = redis_parts
    keys = (digest_of(KEY_A), digest_of(KEY_B))
    caches = [RedisResultCache(url, names), RedisResultCache(url, names)]
    first = await make_rig(**SHARING, store=store, cache=caches[0], cache_ttl_s=60.0, api_keys=keys)
    second = await make_rig(**SHARING, store=store, cache=caches[1], cache_ttl_s=60.0, api_keys=keys, bus=first.bus)
    worker = await first.worker()
    try:
        computed = await infer(first, "redis hello", bearer(KEY_A))
        assert computed.json()["output"] == "olleh sider", computed.text
        hit = await infer(second, "redis hello", bearer(KEY_A))
        assert hit.json()["output"] == "olleh sider" and len(worker.seen) == 1, "the other gateway's hit"
        stored = await store.get(hit.json()["task_id"])
        assert stored is not None and stored.status is TaskStatus.COMPLETED
        assert stored.owner == owner_of(digest_of(KEY_A)), "the hit's task is its caller's"
        other = await infer(second, "redis hello", bearer(KEY_B))
        assert other.json()["output"] == "olleh sider" and len(worker.seen) == 2, "B's request is computed"
    finally:
        for cache in caches:
            await cache.close()
