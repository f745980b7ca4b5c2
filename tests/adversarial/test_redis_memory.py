"""A full Redis (used memory over its maxmemory; noeviction) is answered 503 `unavailable` at once, never 500,
except a synchronous request whose answer the result cache holds (that needs no write), and costs nothing
already accepted: workers keep the results they hold and store them once memory is
free, without crashing or committing early.

Kafka mode only (embedded mode has no Redis). The deployment runs over the session's Kafka and a
PRIVATE redis-server started here with a memory bound, so filling it disturbs no other test.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from infra.redis_server import RedisServer
from schemas.records import Credit, TaskState, TaskStatus
from schemas.wire import Names
from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster, launch, stopped_after
from transport.errors import StoreFullError
from transport.redis.credits import RedisCreditPool
from transport.redis.deliveries import RedisDeliveryLog
from transport.redis.store import RedisTaskStore

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

BOUND = "64mb"
FULL_MESSAGE = "result store is full"
ACCEPTED = 6
REFUSALS = 24


@pytest.fixture
def bounded_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, bounded as the stack runs it (maxmemory, noeviction)."""
    server = RedisServer(tmp_path / "redis", maxmemory=BOUND)
    server.start()
    yield server
    server.stop()


def fill(url: str) -> None:
    """Writes filler until Redis refuses a write for memory, then sets the bound under what it uses.

    A Redis's usage moves with its clients' buffers, so right at the bound a small write sometimes
    fits; under it, every write that needs memory is refused.
    """
    client = redis.Redis.from_url(url)
    try:
        chunk = b"x" * 65_536
        written = 0
        try:
            while written < 100_000:
                client.set(f"filler:{written}", chunk)
                written += 1
        except redis.exceptions.OutOfMemoryError:
            pass
        assert 0 < written < 100_000, f"filling never met the bound ({written} chunks written)"
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used // 2)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            client.set("probe", b"1")
    finally:
        client.close()


def free(url: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        client.config_set("maxmemory", BOUND)
        for key in client.scan_iter("filler:*", count=1000):
            client.delete(key)
        client.set("probe", b"1")  # memory is free: a write goes through
    finally:
        client.close()


async def test_every_redis_write_refused_for_memory_is_a_retriable_store_full_error(
    bounded_redis: RedisServer,
) -> None:
    names = Names(namespace="oom")
    store = RedisTaskStore(bounded_redis.url, names)
    credits = RedisCreditPool(bounded_redis.url, names)
    deliveries = RedisDeliveryLog(bounded_redis.url, names)
    await store.start()
    try:
        fill(bounded_redis.url)
        now_ms = int(time.time() * 1000)
        state = TaskState("t1", TaskStatus.QUEUED, "sim", now_ms, now_ms)
        writes: dict[str, Any] = {
            "create": lambda: store.create(state),
            "apply": lambda: store.apply([state]),
            "claim_key": lambda: store.claim_key("scope", "key", "t1", "fp"),
            "offer": lambda: credits.offer(Credit("w", "sim", 0, 1, now_ms, now_ms + 10_000)),
            "begin": lambda: deliveries.begin("b1", "r1"),
        }
        for name, write in writes.items():
            with pytest.raises(StoreFullError, match=FULL_MESSAGE) as refused:
                await write()
            assert refused.value.retriable, f"{name}: a full store is worth retrying, not a permanent failure"
        assert await store.get("t1") is None, "reads still work (and nothing was half written)"
    finally:
        await deliveries.close()
        await credits.close()
        await store.close()


def _submit(url: str, path: str, text: str, key: str | None = None) -> tuple[httpx.Response, float]:
    headers = {"idempotency-key": key} if key else {}
    started = time.monotonic()
    response = httpx.post(f"{url}{path}", json={"input": text, "timeout_ms": 30_000}, headers=headers, timeout=30)
    return response, time.monotonic() - started


def _redis_full(url: str) -> float:
    """The gateway's ``batchwire_redis_full`` gauge."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    (line,) = (line for line in text.splitlines() if line.startswith("batchwire_redis_full "))
    return float(line.split()[1])


def _logs(cluster: Cluster, prefix: str) -> str:
    logs = (proc.log_path.read_text(errors="replace") for proc in cluster.procs if proc.name.startswith(prefix))
    return "\n".join(logs)


def test_a_full_redis_is_answered_503_and_accepted_tasks_complete_once_it_has_room(
    bounded_redis: RedisServer, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    infra: Any = request.getfixturevalue("infra")
    gateway_args = ("--deterministic-models", "sim", "--cache-ttl-s", "600")  # a cached answer needs no write
    cluster = launch(
        tmp_path, infra.kafka_bootstrap, bounded_redis.url, workers=2, sim_latency_ms=1000, gateway_args=gateway_args
    )
    with stopped_after(request, cluster):
        url = cluster.gateway_urls[0]
        pids = {proc.name: proc.pid for proc in cluster.procs}
        computed, _ = _submit(url, "/v1/inference", "cached")
        assert computed.status_code == 200 and computed.json()["output"] == "dehcac", computed.text
        accepted: dict[str, str] = {}
        for n in range(ACCEPTED):
            response, _ = _submit(url, "/v1/tasks", f"accepted-{n}")
            assert response.status_code == 202, response.text
            accepted[response.json()["task_id"]] = f"accepted-{n}"

        fill(bounded_redis.url)

        # Every submit that writes to the store (async; sync or async with an Idempotency-Key), at once.
        shapes = [("/v1/tasks", False), ("/v1/inference", True), ("/v1/tasks", True)]
        with ThreadPoolExecutor(8) as pool:
            answers = list(
                pool.map(
                    lambda n: _submit(url, shapes[n % 3][0], f"refused-{n}", f"key-{n}" if shapes[n % 3][1] else None),
                    range(REFUSALS),
                )
            )
        for response, took_s in answers:
            assert response.status_code == 503, f"a full store must be 503, got {response.status_code} {response.text}"
            error = response.json()["error"]
            assert error["code"] == "unavailable", error
            assert FULL_MESSAGE in error["message"], f"the message says the result store is full: {error}"
            assert "retry-after" in response.headers, response.headers
            assert took_s < 5.0, f"a refusal took {took_s:.1f} s"
        # A sync submit without a key writes nothing before its answer, which a full Redis could not
        # keep: once the gateway has read that Redis is full, it is refused at once, not held to its deadline.
        eventually_sync(lambda: "Redis is full" in _logs(cluster, "gateway"), "the gateway to see Redis full")
        refused, took_s = _submit(url, "/v1/inference", "sync")
        assert refused.status_code == 503, f"{refused.status_code} {refused.text}"
        assert refused.json()["error"]["code"] == "unavailable" and "retry-after" in refused.headers
        assert FULL_MESSAGE in refused.json()["error"]["message"], refused.text
        assert took_s < 5.0, f"a sync submit was held {took_s:.1f} s by a full Redis"
        hit, took_s = _submit(url, "/v1/inference", "cached")
        assert hit.status_code == 200 and hit.json()["output"] == "dehcac", f"a cache hit needs no write: {hit.text}"
        assert took_s < 5.0, f"a cache hit took {took_s:.1f} s"
        polled_hit, _ = _submit(url, "/v1/tasks", "cached")
        assert polled_hit.status_code == 503, f"a hit to poll must be stored first: {polled_hit.text}"
        assert _redis_full(url) == 1.0, "the gateway's metrics say Redis is full"
        some_id = next(iter(accepted))
        read = httpx.get(f"{url}/v1/result/{some_id}", timeout=10)
        assert read.status_code == 200, f"reads work while Redis is full: {read.status_code} {read.text}"

        # The workers finish their calls and cannot store the results: they hold them and retry.
        eventually_sync(
            lambda: FULL_MESSAGE in _logs(cluster, "worker"), "a worker to meet the full store", timeout_s=30
        )
        assert all(proc.alive() for proc in cluster.procs), cluster.logs()

        free(bounded_redis.url)

        def all_completed() -> bool:
            for task_id, text in accepted.items():
                state = httpx.get(f"{url}/v1/result/{task_id}", timeout=10).json()
                if state.get("status") != "completed":
                    return False
                assert state["output"] == text[::-1], state
            return True

        eventually_sync(
            all_completed, f"the {ACCEPTED} tasks accepted before Redis filled up to complete", timeout_s=60
        )
        eventually_sync(
            lambda: _submit(url, "/v1/inference", "after")[0].status_code == 200, "submits to work again", timeout_s=30
        )
        assert _redis_full(url) == 0.0, "the gateway's metrics say Redis has room again"
        assert {proc.name: proc.pid for proc in cluster.procs if proc.alive()} == pids, "no process exited"
        gateway_log = _logs(cluster, "gateway")
        assert "unhandled error" not in gateway_log, f"the gateway answered a 500: {gateway_log[-3000:]}"
