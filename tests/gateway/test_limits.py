"""Admission: the deployment's queue-depth limit (503) and per-client rate limits (429), before anything is queued."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any
from unittest.mock import patch

import httpx
import pytest
from starlette.requests import Request

from batcher.tokens import estimated
from gateway.admission.validation import LONG_INPUT_CHARS
from gateway.edge.auth import digest_of
from gateway.edge.callers import client_of
from gateway.sharing.answer_keys import AnswerKeys
from schemas.records import TaskStatus
from schemas.wire import Names
from telemetry.metrics import REGISTRY
from tests.support.eventually import eventually
from tests.support.gateway_rig import MODELS, Rig, RigFactory, error_of, http_scope
from tests.support.queue_depth import Counters
from tests.support.task_states import state
from tests.support.transport_kits import ensure_topics
from transport.kafka.lag import KafkaQueueDepth
from transport.kafka.producers import KafkaRequestProducer
from transport.memory.cache import MemoryResultCache
from transport.memory.limits import MemoryRateLimiter
from transport.memory.store import MemoryTaskStore, state_bytes
from transport.ports import Backlog
from transport.redis.limits import RedisRateLimiter
from transport.routing import Partitioner

pytestmark = pytest.mark.timeout(60)


# queue depth ----------------------------------------------------------------------------------------


async def test_beyond_max_queue_depth_is_503_at_once_and_nothing_is_queued(make_rig: RigFactory) -> None:
    rig = await make_rig(queue_depth="bus", max_queue_depth=3, retry_after_s=2)  # no worker: nothing leaves
    for index in range(3):
        assert (await rig.client.post("/v1/tasks", json={"input": f"t{index}"})).status_code == 202

    for path in ("/v1/tasks", "/v1/inference"):
        started = time.monotonic()
        refused = await rig.client.post(path, json={"input": "one too many"})
        elapsed = time.monotonic() - started
        assert refused.status_code == 503, refused.text
        error = error_of(refused)
        assert error["code"] == "overloaded"
        assert "3 requests" in error["message"] and "BATCHWIRE_MAX_QUEUE_DEPTH" in error["message"], error
        assert refused.headers["retry-after"] == "2"
        assert elapsed < 1.0, f"a refusal must be immediate, took {elapsed:.3f} s"
    assert rig.produced() == 3
    assert len(rig.store.created) == 3, "a refused request is not stored"


async def test_the_queue_limit_lifts_as_workers_take_requests(make_rig: RigFactory) -> None:
    rig = await make_rig(queue_depth="bus", max_queue_depth=2)
    for index in range(2):
        await rig.client.post("/v1/tasks", json={"input": f"t{index}"})
    assert (await rig.client.post("/v1/tasks", json={"input": "refused"})).status_code == 503
    await rig.worker()  # commits what it answers: the queue drains
    await eventually(lambda: rig.bus.lag() == 0, "the worker to drain the queue")
    answer = await rig.client.post("/v1/inference", json={"input": "room again"})
    assert answer.status_code == 200, answer.text


async def test_a_concurrent_burst_past_max_queue_depth_is_refused_beyond_the_limit(make_rig: RigFactory) -> None:
    """Each request's check awaits between its queue check and its admission (a long input is counted
    off the event loop; a Redis rate limit is a round trip): the requests checked meanwhile must count
    the ones ahead of them, or a burst passes the limit whole."""
    rig = await make_rig(queue_depth="bus", max_queue_depth=3, max_batch_tokens=100_000, count_tokens=estimated)
    long = "l" * LONG_INPUT_CHARS
    burst = [rig.client.post("/v1/tasks", json={"input": f"{index}{long}"}) for index in range(10)]
    statuses = sorted(response.status_code for response in await asyncio.gather(*burst))

    assert statuses == [202] * 3 + [503] * 7, f"3 of 10 admitted at max_queue_depth=3, got {statuses}"
    assert rig.produced() == 3, f"{rig.produced()} requests reached the bus; the limit is 3"


@pytest.mark.parametrize(
    ("settings", "headers"),
    [({}, {"Idempotency-Key": "same"}), ({"deterministic_models": ("sim",)}, {})],
    ids=["keyed-retries", "collapsed"],
)
async def test_requests_waiting_for_another_ones_task_hold_no_place_in_the_queue(
    make_rig: RigFactory, settings: dict[str, Any], headers: dict[str, str]
) -> None:
    """Retries with the Idempotency-Key of a task in flight, and identical requests that join its
    computation, send nothing: while they wait, the model's queue holds the one request, and another
    request is admitted (normal requests are refused from 3 here)."""
    rig = await make_rig(queue_depth="bus", max_queue_depth=3, **settings)  # no worker yet: the task waits
    body = {"input": "shared", "timeout_ms": 20_000}
    first = asyncio.create_task(rig.client.post("/v1/inference", json=body, headers=headers))
    await eventually(lambda: rig.produced() == 1, "the first request to reach the bus")
    same = [asyncio.create_task(rig.client.post("/v1/inference", json=body, headers=headers)) for _ in range(3)]
    await eventually(lambda: rig.gateway.inflight == 4 or any(s.done() for s in same), "the three to wait")
    assert not any(s.done() for s in same), [s.result().text for s in same if s.done()]

    other = await rig.client.post("/v1/tasks", json={"input": "other"})

    assert other.status_code == 202, f"one request is queued; another must be admitted: {other.text}"
    await rig.worker()
    answers = await asyncio.gather(first, *same)
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert rig.produced() == 2, "the waiting requests sent nothing"


async def test_at_a_full_queue_a_retry_of_a_keyed_task_is_answered_and_a_new_keyed_task_refused(
    make_rig: RigFactory,
) -> None:
    """A retry with the Idempotency-Key of a queued task adds nothing to the queue: it gets its task, not
    a 503 (a client whose response was lost learns its task id however full the queue is). A new task
    under another key is refused, and its key stays free for a retry once the queue has room."""
    rig = await make_rig(queue_depth="bus", max_queue_depth=2)  # no worker yet: nothing leaves
    mine = await rig.client.post("/v1/tasks", json={"input": "mine"}, headers={"Idempotency-Key": "k1"})
    assert mine.status_code == 202, mine.text
    assert (await rig.client.post("/v1/tasks", json={"input": "other"})).status_code == 202
    refused = await rig.client.post("/v1/tasks", json={"input": "new"}, headers={"Idempotency-Key": "k2"})
    assert refused.status_code == 503 and error_of(refused)["code"] == "overloaded", refused.text

    again = await rig.client.post("/v1/tasks", json={"input": "mine"}, headers={"Idempotency-Key": "k1"})

    assert again.status_code == 202, f"the retry of a queued task is answered: {again.text}"
    assert again.json()["task_id"] == mine.json()["task_id"] and again.headers["idempotent-replayed"] == "true"
    assert rig.produced() == 2, "neither the refused task nor the retry was queued"
    await rig.worker()
    await eventually(lambda: rig.bus.lag() == 0, "the worker to drain the queue")
    later = await rig.client.post("/v1/inference", json={"input": "new"}, headers={"Idempotency-Key": "k2"})
    assert later.status_code == 200 and later.json()["output"] == "wen", later.text


async def test_max_queue_depth_zero_turns_the_check_off(make_rig: RigFactory) -> None:
    rig = await make_rig(queue_depth="bus", max_queue_depth=0)
    for index in range(5):
        assert (await rig.client.post("/v1/tasks", json={"input": f"t{index}"})).status_code == 202


@pytest.mark.kafka
async def test_queue_depth_from_the_real_request_topic(make_rig: RigFactory, names: Names, infra: Any) -> None:
    partitions = 4
    await ensure_topics(infra.kafka_bootstrap, {names.request_topic: partitions})
    producer = KafkaRequestProducer(infra.kafka_bootstrap, names, Partitioner(MODELS, partitions))
    depth = KafkaQueueDepth(infra.kafka_bootstrap, names, partitions, refresh_s=0.05)
    await producer.start()
    await depth.start()
    try:
        rig = await make_rig(producer=producer, queue_depth=depth, max_queue_depth=5)  # no batcher at all
        for index in range(5):
            assert (await rig.client.post("/v1/tasks", json={"input": f"t{index}"})).status_code == 202
        deadline = time.monotonic() + 20
        while (await depth.depth() or 0) < 5:  # None until a read answers (a new group's coordinator loads)
            assert time.monotonic() < deadline, "the lag never reached 5"
            await asyncio.sleep(0.02)
        refused = await rig.client.post("/v1/inference", json={"input": "no room"})
        assert refused.status_code == 503, refused.text
        assert error_of(refused)["code"] == "overloaded"
        assert len(rig.store.created) == 5
    finally:
        await depth.close()
        await producer.close()


# the bodies being read ----------------------------------------------------------------------------------


class StalledBody:
    """A POST to /v1/inference from ``host`` whose client sends all of its body but the last byte, then
    waits until ``gone`` is set, and leaves."""

    def __init__(self, app: Any, host: str, size: int, gone: asyncio.Event) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % size)]
        scope = http_scope("POST", "/v1/inference", headers=headers)
        scope["client"] = (host, 40000)
        self._messages = [{"type": "http.request", "body": b'{"input": "' + b"a" * (size - 12), "more_body": True}]
        self._gone = gone
        self.stalled = False
        """The gateway took what was sent and waits for the rest."""
        self.status: int | None = None
        self.answer = b""
        self.task = asyncio.create_task(app(scope, self._receive, self._send))

    async def _receive(self) -> dict[str, Any]:
        if self._messages:
            return self._messages.pop()
        self.stalled = True
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        else:
            self.answer += message.get("body", b"")


async def test_one_clients_stalled_bodies_hold_only_its_share_and_another_clients_body_is_read(
    make_rig: RigFactory,
) -> None:
    """A client whose connections each send all of a body but its last byte and stall holds at most its
    share of the bodies' budget (a quarter): its next body is refused 503 naming the setting, and another
    client's body is still read and answered. Without a share, four such bodies would leave the budget 4
    bytes, and every other client's submit would be refused until the attacker's body timeout, again and
    again."""
    rig = await make_rig(max_body_bytes=1000, max_body_bytes_in_flight=4000)
    await rig.worker()
    gone = asyncio.Event()
    hog = [StalledBody(rig.app, "127.0.0.2", 1000, gone) for _ in range(4)]
    try:
        await eventually(
            lambda: all(body.stalled or body.status is not None for body in hog), "each stalled body read or refused"
        )
        other = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=rig.app, client=("127.0.0.3", 4321)), base_url="http://gateway"
        )
        async with other:
            served = await other.post("/v1/inference", json={"input": "abc"})
        assert (served.status_code, served.json().get("output")) == (200, "cba"), served.text
        refused = [body for body in hog if body.status is not None]
        assert [body.stalled for body in hog].count(True) == 1 and len(refused) == 3, [b.status for b in hog]
        for body in refused:
            error = json.loads(body.answer)["error"]
            assert (body.status, error["code"]) == (503, "overloaded"), body.answer
            assert "this client" in error["message"] and "BATCHWIRE_MAX_BODY_BYTES_IN_FLIGHT" in error["message"]
    finally:
        gone.set()
        await asyncio.gather(*(body.task for body in hog))
    bodies = rig.app.state.deployment.bodies
    assert bodies.held == 0, "the stalled body gives its bytes back once its client leaves"


# rate limits ----------------------------------------------------------------------------------------


def _limited(rate_per_s: float, burst: int, *, trust_client_id: bool = True) -> dict[str, Any]:
    return {
        "limiter": MemoryRateLimiter(rate_per_s, burst),
        "rate_limit_per_s": rate_per_s,
        "rate_limit_burst": burst,
        "trust_client_id": trust_client_id,
    }


async def test_a_client_over_its_rate_gets_429_with_the_wait_and_the_setting(make_rig: RigFactory) -> None:
    rig = await make_rig(**_limited(0.25, 2))
    await rig.worker()
    headers = {"X-Client-Id": "client-1"}
    assert (await rig.client.post("/v1/inference", json={"input": "a"}, headers=headers)).status_code == 200
    assert (await rig.client.post("/v1/tasks", json={"input": "b"}, headers=headers)).status_code == 202

    refused = await rig.client.post("/v1/inference", json={"input": "c"}, headers=headers)

    assert refused.status_code == 429, refused.text
    error = error_of(refused)
    assert error["code"] == "rate_limited"
    assert "0.25 requests/s with bursts of 2" in error["message"], error
    assert "BATCHWIRE_RATE_LIMIT_PER_S" in error["message"] and "BATCHWIRE_RATE_LIMIT_BURST" in error["message"]
    assert 3 <= int(refused.headers["retry-after"]) <= 4, "a token comes every 4 s"
    assert rig.produced() == 2, "a rate-limited request is not queued"
    other = await rig.client.post("/v1/tasks", json={"input": "d"}, headers={"X-Client-Id": "client-2"})
    assert other.status_code == 202, "each client has its own bucket"


async def test_a_request_refused_by_a_full_store_keeps_its_rate_limit_token(make_rig: RigFactory) -> None:
    """The embedded store's memory budget refuses a request (503) as the queue does: it takes none of
    its client's bucket, so the retry the 503 asks for is not refused 429."""
    live = state("live", TaskStatus.QUEUED, model="sim", output="x" * 10_000)
    store = MemoryTaskStore(max_bytes=state_bytes(live))
    assert await store.create(live)  # held by a task not ended: the store is full
    rig = await make_rig(store=store, **_limited(0.01, 2))

    refused = [await rig.client.post("/v1/tasks", json={"input": f"refused{index}"}) for index in range(2)]
    assert [(r.status_code, error_of(r)["code"]) for r in refused] == [(503, "overloaded")] * 2, refused[0].text
    assert await store.apply([state("live", TaskStatus.COMPLETED, model="sim", output="x")]) == [True]
    statuses = [(await rig.client.post("/v1/tasks", json={"input": f"t{index}"})).status_code for index in range(3)]
    assert statuses == [202, 202, 429], "the refused requests took none of the bucket's two tokens"


async def test_without_a_client_id_the_address_is_the_client(make_rig: RigFactory) -> None:
    rig = await make_rig(**_limited(0.1, 1))
    assert (await rig.client.post("/v1/tasks", json={"input": "a"})).status_code == 202
    assert (await rig.client.post("/v1/tasks", json={"input": "b"})).status_code == 429


def test_the_ipv6_peers_of_one_64_block_are_one_client() -> None:
    """One subscriber (a home line, a cloud VM) gets a whole /64 and may send from any address in it:
    counted by address, one machine was as many clients as it liked, each with its own rate limit,
    watchers and share of the bodies being read."""

    def client(host: str) -> str:
        return client_of(Request(http_scope("POST", "/v1/tasks") | {"client": (host, 1234)}), trust_client_id=False)

    assert client("2001:db8:1:2::1") == client("2001:db8:1:2:ffff:ffff:ffff:ffff") == "ip:2001:db8:1:2::/64"
    assert client("2001:db8:1:3::1") != client("2001:db8:1:2::1"), "another block is another client"
    assert client("::ffff:192.0.2.7") == client("192.0.2.7") == "ip:192.0.2.7", "an IPv4 peer seen over IPv6"
    assert client("192.0.2.7") != client("192.0.2.8")
    assert client("fe80::1%eth0") == "ip:fe80::/64"


def test_an_ipv6_peers_client_is_worked_out_once_for_its_many_requests() -> None:
    """Every submit asks who its client is (its body's share, its rate limit): an IPv6 peer, or an IPv4
    one on a dual-stack listener (``::ffff:a.b.c.d``), costs ``ipaddress`` some microseconds a time,
    as much as parsing the request. A peer's keep-alive connection sends many: its client is kept."""

    def client(host: str) -> str:
        return client_of(Request(http_scope("POST", "/v1/tasks") | {"client": (host, 1234)}), trust_client_id=False)

    peer = "2001:db8:7:7::" + secrets.token_hex(2)
    with patch.object(ipaddress, "IPv6Address", wraps=ipaddress.IPv6Address) as parsed:
        first = client(peer)
        once = parsed.call_count
        answers = {client(peer) for _ in range(99)}
    assert answers == {first} == {"ip:2001:db8:7:7::/64"}, (first, answers)
    assert parsed.call_count == once, f"100 requests parsed the peer's address {parsed.call_count} times, one {once}"


async def test_an_untrusted_client_id_is_ignored_and_the_address_is_the_client(make_rig: RigFactory) -> None:
    """Without --trust-client-id any caller could name another's bucket (and drain it), or make up
    a new id per request to escape its own: the header chooses nothing."""
    rig = await make_rig(**_limited(0.1, 1, trust_client_id=False))
    first = await rig.client.post("/v1/tasks", json={"input": "a"}, headers={"X-Client-Id": "victim"})
    assert first.status_code == 202, first.text
    escape = await rig.client.post("/v1/tasks", json={"input": "b"}, headers={"X-Client-Id": "fresh-id"})
    assert escape.status_code == 429, "a made-up id is not a new bucket"
    odd = await rig.client.post("/v1/tasks", json={"input": "c"}, headers={"X-Client-Id": "a b"})
    assert odd.status_code == 429, "an ignored header is not validated either"
    spec = (await rig.client.get("/openapi.json")).json()
    names = [p["name"] for p in spec["paths"]["/v1/tasks"]["post"].get("parameters", [])]
    assert "X-Client-Id" not in names, "the header is documented only where it is trusted"


async def test_with_api_keys_the_key_is_the_client_whatever_it_claims(make_rig: RigFactory) -> None:
    key = "charlie-key-0123456789"
    rig = await make_rig(api_keys=(digest_of(key),), **_limited(0.1, 1))
    auth = {"Authorization": f"Bearer {key}"}
    assert (await rig.client.post("/v1/tasks", json={"input": "a"}, headers={**auth, "X-Client-Id": "x"})).is_success
    second = await rig.client.post("/v1/tasks", json={"input": "b"}, headers={**auth, "X-Client-Id": "y"})
    assert second.status_code == 429, "a key cannot escape its limit by claiming another client id"


@pytest.mark.parametrize("client_id", ["", "a b", "x" * 129])
async def test_a_malformed_client_id_is_400(make_rig: RigFactory, client_id: str) -> None:
    rig = await make_rig(**_limited(10, 10))
    response = await rig.client.post("/v1/tasks", json={"input": "x"}, headers={"X-Client-Id": client_id})
    assert response.status_code == 400, response.text
    assert error_of(response)["code"] == "invalid_client_id"
    assert rig.store.created == []


async def test_rate_limits_off_cost_no_check(make_rig: RigFactory) -> None:
    class Exploding(MemoryRateLimiter):
        async def acquire(self, client: str, tokens: int = 1) -> float:
            raise AssertionError("the limiter must not be asked when rate limits are off")

    rig = await make_rig(limiter=Exploding(1, 1), rate_limit_per_s=0)
    for index in range(3):
        assert (await rig.client.post("/v1/tasks", json={"input": f"{index}"})).status_code == 202


async def test_the_time_a_slow_rate_limiter_takes_comes_out_of_the_callers_deadline(make_rig: RigFactory) -> None:
    """A store that answers slowly (the rate limiter's Redis) delays admission: the caller still hears by
    its ``timeout_ms`` from the submit, and the request carries what is left of it."""
    slow_s, timeout_ms = 1.5, 2000

    class Slow(MemoryRateLimiter):
        async def acquire(self, client: str, tokens: int = 1) -> float:
            await asyncio.sleep(slow_s)  # the slow store under test
            return await super().acquire(client, tokens)

    rig = await make_rig(**{**_limited(10, 10), "limiter": Slow(10, 10)})  # no worker: no answer comes
    started = time.monotonic()
    response = await rig.client.post("/v1/inference", json={"input": "x", "timeout_ms": timeout_ms})
    took_s = time.monotonic() - started

    assert response.status_code == 504, response.text
    assert took_s < slow_s + timeout_ms / 1000 - 0.5, f"answered {took_s:.2f} s after the submit, past its deadline"
    request = rig.only_request()
    assert request.deadline_ms - request.enqueued_at_ms <= timeout_ms - slow_s * 1000 + 250, request


@pytest.fixture
async def redis_limiters(infra: Any, names: Names) -> AsyncIterator[list[RedisRateLimiter]]:
    limiters = [RedisRateLimiter(infra.redis_url, names, 0.2, 3) for _ in range(2)]
    yield limiters
    for limiter in limiters:
        await limiter.close()


@pytest.mark.kafka
async def test_two_gateways_share_each_clients_bucket_through_redis(
    make_rig: RigFactory, redis_limiters: list[RedisRateLimiter]
) -> None:
    first = await make_rig(limiter=redis_limiters[0], rate_limit_per_s=0.2, rate_limit_burst=3, trust_client_id=True)
    second = await make_rig(limiter=redis_limiters[1], rate_limit_per_s=0.2, rate_limit_burst=3, trust_client_id=True)
    headers = {"X-Client-Id": "roaming"}
    statuses = [
        (await gateway.client.post("/v1/tasks", json={"input": "x"}, headers=headers)).status_code
        for gateway in (first, second, first, second, first)
    ]
    assert statuses == [202, 202, 202, 429, 429], "three tokens in all, whichever gateway takes them"
    assert first.produced() + second.produced() == 3


# answers that need no queue work ----------------------------------------------------------------------

SHARED: dict[str, Any] = {"deterministic_models": ("sim",), "cache_ttl_s": 60.0}


def tier_submits(outcome: str, model: str = "sim", priority: str = "normal") -> float:
    value = REGISTRY.get_sample_value(
        "batchwire_tier_submits_total", {"model": model, "priority": priority, "outcome": outcome}
    )
    return value or 0.0


async def _cache_popular(rig: Rig, cache: MemoryResultCache) -> None:
    """The cache holds the answer of input ``popular`` (model sim, no API key)."""
    key = AnswerKeys(rig.settings).key(None, "sim", "popular")
    assert key is not None, "sim must be deterministic here"
    await cache.put(key, "ralupop", 60.0)


async def test_a_cache_hit_is_answered_while_its_models_queue_is_full(make_rig: RigFactory) -> None:
    """A hit adds nothing to the queue: the depth limit refuses only requests that would be queued."""
    cache = MemoryResultCache()
    rig = await make_rig(queue_depth="bus", max_queue_depth=2, cache=cache, **SHARED)  # no worker: nothing leaves
    await _cache_popular(rig, cache)
    for index in range(2):
        assert (await rig.client.post("/v1/tasks", json={"input": f"t{index}"})).status_code == 202
    admitted = tier_submits("admitted")

    hit = await rig.client.post("/v1/inference", json={"input": "popular"})
    polled_hit = await rig.client.post("/v1/tasks", json={"input": "popular"})
    miss = await rig.client.post("/v1/inference", json={"input": "unpopular"})

    assert hit.status_code == 200 and hit.json()["output"] == "ralupop", hit.text
    assert polled_hit.status_code == 202 and polled_hit.json()["status"] == "completed", polled_hit.text
    assert miss.status_code == 503 and error_of(miss)["code"] == "overloaded", miss.text
    assert "BATCHWIRE_MAX_QUEUE_DEPTH" in error_of(miss)["message"], miss.text
    assert rig.produced() == 2, "the hits queued nothing, and the miss was refused"
    assert tier_submits("admitted") - admitted == 2, "the two hits count as admitted"
    assert rig.gateway.inflight == 0


async def test_a_request_that_joins_a_computation_in_flight_is_answered_while_the_queue_is_full(
    make_rig: RigFactory,
) -> None:
    """A caller that joins an identical computation in flight sends nothing: the depth limit refuses
    only a request that would start one of its own."""
    rig = await make_rig(queue_depth="bus", max_queue_depth=2, deterministic_models=("sim",))  # no worker yet
    body = {"input": "shared", "timeout_ms": 20_000}
    first = asyncio.create_task(rig.client.post("/v1/inference", json=body))
    await eventually(lambda: rig.produced() == 1, "the first request to reach the bus")
    assert (await rig.client.post("/v1/tasks", json={"input": "other"})).status_code == 202  # the queue is full
    refused_before = tier_submits("refused")

    joiner = asyncio.create_task(rig.client.post("/v1/inference", json=body))
    await eventually(lambda: rig.gateway.inflight == 2 or joiner.done(), "the joiner to wait")
    starter = await rig.client.post("/v1/inference", json={"input": "not shared", "timeout_ms": 20_000})

    assert not joiner.done(), joiner.result().text
    assert starter.status_code == 503 and error_of(starter)["code"] == "overloaded", starter.text
    assert tier_submits("refused") - refused_before == 1, "only the request to be queued is refused"
    await rig.worker()
    answers = await asyncio.gather(first, joiner)
    outcomes = [(a.status_code, a.json().get("output")) for a in answers]
    assert outcomes == [(200, "derahs")] * 2, [a.text for a in answers]
    assert rig.produced() == 2, "the joiner sent nothing; the refused request was not queued"


async def test_a_cache_hit_is_answered_while_its_model_is_refused_by_predicted_wait(make_rig: RigFactory) -> None:
    """A stalled model's submits are refused by the predicted-wait check; a hit needs no worker."""
    counters = Counters()
    cache = MemoryResultCache()
    rig = await make_rig(queue_depth=counters, stall_s=2.0, cache=cache, **SHARED)
    await _cache_popular(rig, cache)
    for n in range(1, 26):  # requests wait and no batch leaves for 2.5 s, sampled every 0.1 s
        counters.backlogs = {"sim": Backlog(5, 0, 0, n / 10)}
        rig.gateway.models()
    assert rig.gateway.models()["sim"] == "stalled"

    hit = await rig.client.post("/v1/inference", json={"input": "popular"})
    miss = await rig.client.post("/v1/inference", json={"input": "unpopular"})

    assert hit.status_code == 200 and hit.json()["output"] == "ralupop", hit.text
    assert miss.status_code == 503 and "taken none for 2 s" in error_of(miss)["message"], miss.text
    assert rig.produced() == 0


async def test_a_cache_hit_still_takes_its_rate_limit_token_and_a_refused_miss_takes_none(
    make_rig: RigFactory,
) -> None:
    """Served without queueing, a hit is still a request of its client's; a miss the full queue refuses
    gives its token back, as any request refused 503 takes none."""
    cache = MemoryResultCache()
    rig = await make_rig(queue_depth="bus", max_queue_depth=2, cache=cache, **SHARED, **_limited(0.01, 3))
    await _cache_popular(rig, cache)
    headers = {"X-Client-Id": "filler"}
    for index in range(2):
        assert (await rig.client.post("/v1/tasks", json={"input": f"t{index}"}, headers=headers)).status_code == 202
    headers = {"X-Client-Id": "client-1"}

    refused = [await rig.client.post("/v1/inference", json={"input": f"miss{i}"}, headers=headers) for i in range(3)]
    hits = [await rig.client.post("/v1/inference", json={"input": "popular"}, headers=headers) for _ in range(4)]

    assert [r.status_code for r in refused] == [503] * 3, [r.text for r in refused]
    assert [h.status_code for h in hits] == [200, 200, 200, 429], [h.text for h in hits]
    assert error_of(hits[-1])["code"] == "rate_limited"
