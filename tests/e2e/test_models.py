"""Real models and several models: a tiny transformers model served end to end over Kafka and Redis,
and two models side by side, where a flood for one does not delay the other."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from schemas.wire import Names
from tests.support.eventually import eventually_sync
from tests.support.http_calls import collect_events
from tests.support.processes import Cluster

pytestmark = pytest.mark.slow


def _wait_for_credits(redis_url: str, namespace: str, model: str, count: int, timeout_s: float = 120) -> None:
    client = redis.Redis.from_url(redis_url)
    key = Names(namespace).credit_queue(model)
    try:
        eventually_sync(lambda: client.zcard(key) >= count, f"{count} idle {model} workers", timeout_s=timeout_s)
    finally:
        client.close()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu_worker.backends.tiny import build_tiny_causal_lm  # torch: imported by the tests that use it

    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "tiny-gpt2", arch="gpt2")


@contextmanager
def _cluster(base: Path, infra: Any, models: str, add_workers: Callable[[Cluster], None]) -> Iterator[Cluster]:
    """Gateway and batcher for ``models``, the workers ``add_workers`` starts, each model's credits offered."""
    namespace = f"m{uuid.uuid4().hex[:8]}"
    cluster = Cluster(base, infra.kafka_bootstrap, infra.redis_url, namespace, extra_env={"BATCHWIRE_MODELS": models})
    try:
        cluster.gateway(0)
        cluster.batcher(0)
        add_workers(cluster)
        for model in models.split(","):
            _wait_for_credits(infra.redis_url, namespace, model, 1)
    except BaseException:
        print(cluster.logs())
        cluster.stop()
        raise
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def hf_cluster(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest, tiny_model: Path
) -> Iterator[Cluster]:
    def add_workers(cluster: Cluster) -> None:
        cluster.spawn(
            "worker0", "worker", "--worker-id", "hf0", "--model", "tiny", "--backend", "hf",
            "--model-path", str(tiny_model), "--hf-max-new-tokens", "8", "--batch-log", str(cluster.batch_log),
        )  # fmt: skip

    with _cluster(tmp_path_factory.mktemp("hf"), request.getfixturevalue("infra"), "tiny", add_workers) as cluster:
        yield cluster


async def test_a_tiny_transformers_model_answers_sync_poll_and_sse(hf_cluster: Cluster, tiny_model: Path) -> None:
    from gpu_worker.backends.hf import HFBackend

    reference = HFBackend(tiny_model, max_new_tokens=8, warmup=False)
    reference.load()
    inputs = ["hello", "a longer prompt with more bytes", "é"]
    expected = {text: reference.batchstring([text])[0] for text in inputs}
    url = hf_cluster.gateway_urls[0]
    async with httpx.AsyncClient(timeout=60) as client:
        sync = await asyncio.gather(
            *(client.post(f"{url}/v1/inference", json={"input": text, "model": "tiny"}) for text in inputs)
        )
        for text, response in zip(inputs, sync, strict=True):
            assert response.status_code == 200, response.text
            assert response.json()["output"] == expected[text], "served answer = one-by-one generation"
        task = (await client.post(f"{url}/v1/tasks", json={"input": "hello", "model": "tiny"})).json()
        polled = (await client.get(f"{url}/v1/result/{task['task_id']}", params={"wait": 30})).json()
        assert polled["status"] == "completed" and polled["output"] == expected["hello"]
        streamed_task = (await client.post(f"{url}/v1/tasks", json={"input": "é", "model": "tiny"})).json()
        events = await asyncio.wait_for(collect_events(client, url, streamed_task["task_id"]), 30)
        assert events[-1][0] == "completed" and events[-1][1]["output"] == expected["é"]
        unknown = await client.post(f"{url}/v1/inference", json={"input": "x", "model": "nope"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_model"


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    def add_workers(cluster: Cluster) -> None:
        # Model a gets a tiny worker (2 items per 100 ms: 20 req/s), so a flood that a test client on
        # this 2-core machine can send without becoming the bottleneck itself saturates it.
        cluster.worker(0, "--model", "a", "--max-batch", "2")
        cluster.worker(1, "--model", "b")

    with _cluster(tmp_path_factory.mktemp("two"), request.getfixturevalue("infra"), "a,b", add_workers) as cluster:
        yield cluster


async def _open_loop(
    client: httpx.AsyncClient, url: str, model: str, rate: float, duration_s: float, timeout_ms: int
) -> list[tuple[int, float]]:
    """Sends at a fixed rate without waiting for answers; returns (status, latency_s) per request."""
    results: list[tuple[int, float]] = []

    async def one(n: int) -> None:
        started = time.monotonic()
        try:
            response = await client.post(
                f"{url}/v1/inference", json={"input": f"{model}{n}", "model": model, "timeout_ms": timeout_ms}
            )
            results.append((response.status_code, time.monotonic() - started))
            if response.status_code == 200:
                assert response.json()["output"] == f"{model}{n}"[::-1]
        except httpx.HTTPError:
            results.append((0, time.monotonic() - started))

    tasks = []
    start = time.monotonic()
    for n in range(int(rate * duration_s)):
        delay = start + n / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)  # pacing the generator, not synchronising on the system
        tasks.append(asyncio.create_task(one(n)))
    await asyncio.gather(*tasks)
    return results


def _summary(results: list[tuple[int, float]]) -> dict[str, Any]:
    ok = sorted(latency for status, latency in results if status == 200)
    return {
        "sent": len(results),
        "statuses": dict(Counter(status for status, _ in results)),
        "p50_ms": round(statistics.median(ok) * 1000, 1) if ok else None,
        "p99_ms": round(ok[int(len(ok) * 0.99) - 1] * 1000, 1) if ok else None,
    }


async def test_a_flood_for_model_a_does_not_delay_model_b(two_models: Cluster) -> None:
    url = two_models.gateway_urls[0]
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        alone = _summary(await _open_loop(client, url, "b", 10, 3, 10_000))
        flood, during = await asyncio.gather(
            _open_loop(client, url, "a", 60, 6, 3_000),  # 3x model a's capacity
            _open_loop(client, url, "b", 10, 6, 10_000),
        )
    flood_summary, during_summary = _summary(flood), _summary(during)
    print(f"\nmodel b alone: {alone}\nmodel a flooded: {flood_summary}\nmodel b during the flood: {during_summary}")
    assert during_summary["statuses"] == {200: len(during)}, "every model b request is answered"
    assert flood_summary["statuses"].get(504, 0) + flood_summary["statuses"].get(503, 0) > 0 or (
        flood_summary["p50_ms"] is not None and flood_summary["p50_ms"] > 500
    ), f"model a must actually be saturated for this test to mean anything: {flood_summary}"
    assert during_summary["p50_ms"] is not None and alone["p50_ms"] is not None
    assert during_summary["p50_ms"] < max(3 * alone["p50_ms"], 350), (
        f"model b's median latency went from {alone['p50_ms']} ms to {during_summary['p50_ms']} ms in model a's flood"
    )
