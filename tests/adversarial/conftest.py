"""Services to attack: ``batchwire up``, and a Kafka-mode gateway with a batcher and two sim workers; and a
lone redis-server of a test's own (``tests.support.lone_redis``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.adversarial_rig import Service, ServiceFactory
from tests.support.lone_redis import primary  # noqa: F401 (pytest finds fixtures by name)
from tests.support.processes import Cluster, embedded, launch


@pytest.fixture
def embedded_service_factory(tmp_path: Path) -> Iterator[ServiceFactory]:
    """Starts ``batchwire up`` with extra flags (two 100 ms sim workers); stopped after the test."""
    started: list[Service] = []

    def start(*flags: str, workers: int = 2, sim_latency_ms: float = 100.0) -> Service:
        base = tmp_path / f"embedded{len(started)}"
        base.mkdir()
        proc, url = embedded(base, workers, sim_latency_ms, *flags)
        service = Service("embedded", url, proc)
        started.append(service)
        return service

    yield start
    for service in started:
        service.proc.stop()


@pytest.fixture
def kafka_service_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServiceFactory]:
    """Starts a Kafka-mode deployment (one gateway with extra flags, one batcher, sim workers) over
    the session's Kafka and Redis; the service's process is the gateway."""
    infra: Any = request.getfixturevalue("infra")
    clusters: list[Cluster] = []

    def start(
        *gateway_flags: str,
        workers: int = 2,
        sim_latency_ms: float = 100.0,
        batcher_flags: tuple[str, ...] = (),
        worker_flags: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
    ) -> Service:
        base = tmp_path / f"kafka{len(clusters)}-{uuid.uuid4().hex[:6]}"
        base.mkdir()
        cluster = launch(
            base,
            infra.kafka_bootstrap,
            infra.redis_url,
            workers=workers,
            sim_latency_ms=sim_latency_ms,
            batcher_args=batcher_flags,
            worker_args=worker_flags,
            gateway_args=gateway_flags,
            extra_env=extra_env,
        )
        clusters.append(cluster)
        gateway = next(proc for proc in cluster.procs if proc.name.startswith("gateway"))
        return Service("kafka", cluster.gateway_urls[0], gateway, cluster)

    yield start
    failed = request.session.testsfailed
    for cluster in clusters:
        cluster.stop()
        if failed:
            print(cluster.logs())


@pytest.fixture(params=["embedded", "kafka"])
def service_factory(request: pytest.FixtureRequest) -> ServiceFactory:
    """One of the two factories above: a test that uses it runs against both modes."""
    factory: ServiceFactory = request.getfixturevalue(f"{request.param}_service_factory")
    return factory


@pytest.fixture
def service(service_factory: ServiceFactory) -> Service:
    """A service with default settings, in each mode."""
    return service_factory()
