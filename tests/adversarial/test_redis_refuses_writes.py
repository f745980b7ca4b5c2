"""A Redis that refuses writes though it has room (``NOREPLICAS``: fewer replicas than its
``min-replicas-to-write``) refuses a plain synchronous request 503 `unavailable` at once, naming why,
rather than holding it to its deadline for an answer no worker could store; once Redis takes writes
again, requests are answered.

Kafka mode only (embedded mode has no Redis). The deployment runs over the session's Kafka and a
PRIVATE redis-server started here, so its refusals disturb no other test.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from infra.redis_server import RedisServer
from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster, launch, stopped_after

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

TIMEOUT_MS = 20_000


def _sync(url: str, text: str) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = httpx.post(f"{url}/v1/inference", json={"input": text, "timeout_ms": TIMEOUT_MS}, timeout=30)
    return response, time.monotonic() - started


def _gauge(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    (line,) = (line for line in text.splitlines() if line.startswith("batchwire_redis_refuses_writes "))
    return float(line.split()[1])


def _gateway_log(cluster: Cluster) -> str:
    return "\n".join(p.log_path.read_text(errors="replace") for p in cluster.procs if p.name.startswith("gateway"))


def test_a_redis_short_of_replicas_refuses_a_sync_request_at_once_and_answers_once_back(
    primary: RedisServer, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    infra: Any = request.getfixturevalue("infra")
    cluster = launch(tmp_path, infra.kafka_bootstrap, primary.url, workers=1)
    with stopped_after(request, cluster), redis.Redis.from_url(primary.url) as admin:
        url = cluster.gateway_urls[0]
        answered, _ = _sync(url, "before")
        assert answered.status_code == 200 and answered.json()["output"] == "erofeb", answered.text

        admin.config_set("min-replicas-to-write", 1)  # no replica is connected: every write is refused
        eventually_sync(lambda: "Redis refuses writes" in _gateway_log(cluster), "the gateway to see the refusal")
        refused, took_s = _sync(url, "refused")
        assert refused.status_code == 503, f"{refused.status_code} {refused.text}"
        error = refused.json()["error"]
        assert error["code"] == "unavailable" and "NOREPLICAS" in error["message"], error
        assert "retry-after" in refused.headers, refused.headers
        assert took_s < TIMEOUT_MS / 1000 / 4, f"the refusal took {took_s:.1f} s: the request was held"
        assert _gauge(url) == 1.0, "the gateway's metrics say Redis refuses writes"

        admin.config_set("min-replicas-to-write", 0)

        def answered_again() -> bool:
            response, _ = _sync(url, "after")
            return response.status_code == 200 and response.json()["output"] == "retfa"

        eventually_sync(answered_again, "a request to be answered once Redis takes writes", timeout_s=30)
        assert _gauge(url) == 0.0
