"""A real model: a tiny transformers model served end to end over Kafka and Redis.

(That a flood for one model does not delay another is asserted in tests/adversarial/test_overload.py,
in both modes.)"""

from __future__ import annotations

import asyncio
import uuid
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
    from batchwire.bench.tiny_models import build_tiny_causal_lm  # torch: imported by the tests that use it

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
