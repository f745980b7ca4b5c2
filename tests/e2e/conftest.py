"""The system under test, two ways: multi-process over Kafka and Redis, and embedded in one process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.local_stack import LocalStack
from tests.support.e2e_system import System
from tests.support.processes import Cluster, Proc, embedded, launch, stopped_after


def start_cluster(base: Path, infra: Any) -> Cluster:
    """The shared multi-process system: two gateways, a batcher and two workers."""
    return launch(base, infra.kafka_bootstrap, infra.redis_url, gateways=2)


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
    with stopped_after(request, start_cluster(base, infra)) as cluster:
        yield System("kafka", cluster.gateway_urls, cluster.batch_log, cluster)


@pytest.fixture(scope="module")
def kafka_system(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    base = tmp_path_factory.mktemp("kafka")
    with stopped_after(request, start_cluster(base, request.getfixturevalue("infra"))) as cluster:
        yield System("kafka", cluster.gateway_urls, cluster.batch_log, cluster)


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


@pytest.fixture(scope="module")
def private_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """A Kafka broker and a Redis of the module's own, to stop, restart or freeze without disturbing the
    tests that share the session's servers."""
    with LocalStack(tmp_path_factory.mktemp("private-stack")) as stack:
        yield stack
