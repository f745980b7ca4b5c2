"""The system under test, two ways: multi-process over Kafka and Redis, and embedded in one process."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from schemas.wire import Names
from tests.e2e.harness import Cluster, Proc, embedded, wait_until


@dataclass
class System:
    kind: str
    urls: list[str]
    journal_path: Path
    cluster: Cluster | None = None

    def journal(self) -> list[dict[str, Any]]:
        import json

        if not self.journal_path.exists():
            return []
        return [json.loads(line) for line in self.journal_path.read_text().splitlines() if line.strip()]


def start_cluster(
    base: Path,
    infra: Any,
    gateways: int = 2,
    batchers: int = 1,
    workers: int = 2,
    sim_latency_ms: float = 100.0,
    batcher_args: tuple[str, ...] = (),
) -> Cluster:
    namespace = f"e2e{uuid.uuid4().hex[:8]}"
    cluster = Cluster(base, infra.kafka_bootstrap, infra.redis_url, namespace, sim_latency_ms=sim_latency_ms)
    try:
        for index in range(gateways):
            cluster.gateway(index)
        for index in range(batchers):
            cluster.batcher(index, *batcher_args)
        for index in range(workers):
            cluster.worker(index)
        client = redis.Redis.from_url(infra.redis_url)
        credits = Names(namespace).credit_list("sim")
        wait_until(lambda: client.llen(credits) >= workers, 60, f"{workers} idle workers to offer credits")
        client.close()
    except BaseException:
        print(cluster.logs())
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="module", params=["embedded", "kafka"])
def system(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    base = tmp_path_factory.mktemp(request.param)
    if request.param == "embedded":
        proc: Proc
        proc, url = embedded(base)
        yield System("embedded", [url], base / "batches.jsonl")
        proc.stop()
        return
    infra = request.getfixturevalue("infra")
    cluster = start_cluster(base, infra)
    yield System("kafka", cluster.gateway_urls, cluster.batch_log, cluster)
    failed = request.session.testsfailed
    cluster.stop()
    if failed:
        print(cluster.logs())


@pytest.fixture(scope="module")
def kafka_system(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    base = tmp_path_factory.mktemp("kafka")
    cluster = start_cluster(base, request.getfixturevalue("infra"))
    yield System("kafka", cluster.gateway_urls, cluster.batch_log, cluster)
    failed = request.session.testsfailed
    cluster.stop()
    if failed:
        print(cluster.logs())


@pytest.fixture
def clusters(request: pytest.FixtureRequest) -> Iterator[list[Cluster]]:
    """Clusters a test launches; stopped afterwards, their logs printed when the test failed."""
    started: list[Cluster] = []
    yield started
    failed = request.session.testsfailed
    for cluster in started:
        cluster.stop()
        if failed:
            print(cluster.logs())
