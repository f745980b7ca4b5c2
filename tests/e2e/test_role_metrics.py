"""Each separate role's ``/metrics`` serves the families it writes, and no other role's: a worker's
``batchwire_redis_full 0`` or ``batchwire_inflight_requests 0`` would enter a sum or a mean across the fleet.
Embedded, the one process serves them all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from infra.ports import free_port
from telemetry.metrics import BATCHER_EXPORTS, GATEWAY_EXPORTS, REGISTRY, WORKER_EXPORTS
from tests.support.processes import Cluster, embedded, launch

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


def _typed(text: str) -> set[str]:
    """The families a text exposition declares (``# TYPE`` lines: a counter's name ends in ``_total``), with
    or without samples; not the ``_created`` series each counter and histogram with samples declares too."""
    declared = (line.split()[2] for line in text.splitlines() if line.startswith("# TYPE "))
    return {name for name in declared if not name.endswith("_created")}


def _families(url: str) -> set[str]:
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, f"{url}: {response.status_code} {response.text[:200]}"
    return _typed(response.text)


def _names(registry: CollectorRegistry) -> set[str]:
    return _typed(generate_latest(registry).decode())


def _answer(url: str) -> None:
    response = httpx.post(f"{url}/v1/inference", json={"input": "abc"}, timeout=30)
    assert response.status_code == 200 and response.json()["output"] == "cba", response.text


def test_each_separate_role_serves_only_the_families_it_writes(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    batcher_port, worker_port = free_port(), free_port()
    cluster = launch(
        tmp_path,
        infra.kafka_bootstrap,
        infra.redis_url,
        workers=1,
        batcher_args=("--metrics-port", str(batcher_port)),
        worker_args=("--metrics-port", str(worker_port)),
    )
    clusters.append(cluster)
    url = cluster.gateway_urls[0]
    _answer(url)
    served = {
        "gateway": _families(f"{url}/metrics"),
        "batcher": _families(f"http://127.0.0.1:{batcher_port}/metrics"),
        "worker": _families(f"http://127.0.0.1:{worker_port}/metrics"),
    }
    assert {"batchwire_inflight_requests", "batchwire_redis_full"} <= served["gateway"], served["gateway"]
    gateway_gauges = {"batchwire_inflight_requests", "batchwire_redis_full", "batchwire_open_watchers"}
    worker_own = {"batchwire_backend_call_seconds", "batchwire_worker_busy_seconds_total"}
    foreign = {
        "batcher": sorted(served["batcher"] & gateway_gauges),
        "worker": sorted(served["worker"] & gateway_gauges),
        "gateway": sorted(served["gateway"] & worker_own),
    }
    assert not any(foreign.values()), f"each role serves another role's families, which it never writes: {foreign}"
    assert {"batchwire_batch_size", "batchwire_batcher_pending"} <= served["batcher"], served["batcher"]
    assert worker_own <= served["worker"], served["worker"]
    for role, registry in (("gateway", GATEWAY_EXPORTS), ("batcher", BATCHER_EXPORTS), ("worker", WORKER_EXPORTS)):
        assert served[role] == _names(registry), (
            f"the {role} serves {sorted(served[role] - _names(registry))} beyond its own families "
            f"and lacks {sorted(_names(registry) - served[role])}"
        )
    for role in served:
        assert "batchwire_tasks_ended_total" in served[role], f"every role ends tasks; the {role} does not say so"


def test_the_embedded_service_serves_every_family(tmp_path: Path) -> None:
    proc, url = embedded(tmp_path, workers=1)
    try:
        _answer(url)
        served = _families(f"{url}/metrics")
    finally:
        proc.stop()
    assert served == _names(REGISTRY), (
        f"embedded /metrics lacks {sorted(_names(REGISTRY) - served)}, serves {sorted(served - _names(REGISTRY))}"
    )
