"""While the bus (or the store) is known to be down, a submit is refused at once, and the gateway
takes work again by itself once it is back.

A Kafka-mode deployment runs over a PRIVATE broker and Redis server (``LocalStack``), so stopping
them disturbs no other test, whatever infrastructure the session uses.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infra.local_stack import LocalStack
from tests.support.adversarial_rig import Service
from tests.support.eventually import eventually_sync
from tests.support.metrics import ready_series
from tests.support.processes import launch, stopped_after

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timing]

REFUSALS = 50
FAST_MS = 100.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    private = LocalStack(tmp_path_factory.mktemp("bus-down-stack"))
    private.start()
    yield private
    private.close()


@pytest.fixture
def service(stack: LocalStack, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Service]:
    cluster = launch(tmp_path, stack.kafka_bootstrap, stack.redis_url, workers=2, sim_latency_ms=20)
    with stopped_after(request, cluster) as started:
        gateway = next(proc for proc in started.procs if proc.name.startswith("gateway"))
        yield Service("kafka", started.gateway_urls[0], gateway, started)


def readiness(client: httpx.Client) -> tuple[int, dict[str, bool]]:
    try:
        response = client.get("/readyz", timeout=5)
    except httpx.HTTPError:
        return 0, {}
    return response.status_code, response.json().get("checks", {})


def ready_gauge(client: httpx.Client) -> dict[str, float]:
    """``batchwire_ready`` by check, as a Prometheus scrape of ``/metrics`` reads it now."""
    try:
        response = client.get("/metrics", timeout=5)
    except httpx.HTTPError:
        return {}
    return ready_series(response.text) if response.status_code == 200 else {}


def submits_succeed(client: httpx.Client, label: str, count: int = 5) -> bool:
    """``count`` sync submits in a row, each answered with its own reversal."""
    for n in range(count):
        text = f"{label}-{n}"
        try:
            response = client.post("/v1/inference", json={"input": text, "timeout_ms": 5000}, timeout=10)
        except httpx.HTTPError:
            return False
        if response.status_code != 200 or response.json().get("output") != text[::-1]:
            return False
    return True


def refused_fast(client: httpx.Client, part: str) -> None:
    """``REFUSALS`` submits, sync and async alternately, each 503 ``unavailable`` with Retry-After in < FAST_MS."""
    slow: list[str] = []
    for n in range(REFUSALS):
        path = "/v1/inference" if n % 2 == 0 else "/v1/tasks"
        started = time.monotonic()
        response = client.post(path, json={"input": f"while down {n}", "timeout_ms": 10_000}, timeout=30)
        took_ms = (time.monotonic() - started) * 1000
        assert response.status_code == 503, f"{path} while the {part} is down: {response.status_code} {response.text}"
        error = response.json()["error"]
        assert error["code"] == "unavailable", error
        assert part in error["message"], f"the message names the {part}: {error}"
        assert "retry-after" in response.headers, response.headers
        if took_ms >= FAST_MS:
            slow.append(f"{path} {took_ms:.0f} ms")
    assert not slow, f"every refusal must come within {FAST_MS:g} ms while the {part} is known down; slow: {slow}"


def test_a_submit_while_kafka_is_down_is_refused_at_once_and_work_resumes_after(
    stack: LocalStack, service: Service
) -> None:
    with httpx.Client(base_url=service.url) as client:
        assert submits_succeed(client, "before"), "the deployment must work before the outage"
        stack.stop_kafka()
        try:
            eventually_sync(
                lambda: readiness(client)[1].get("kafka") is False, "/readyz to report Kafka down", timeout_s=30
            )
            gauge = ready_gauge(client)
            assert gauge.get("kafka") == 0, f"/metrics while Kafka is down: {gauge}"
            refused_fast(client, "request bus")
        finally:
            stack.start_kafka()
        eventually_sync(
            lambda: readiness(client)[0] == 200, "/readyz to be ready again after Kafka restarted", timeout_s=60
        )
        eventually_sync(
            lambda: set(ready_gauge(client).values()) == {1.0}, "/metrics to show every check passing", timeout_s=30
        )
        eventually_sync(lambda: submits_succeed(client, "after"), "submits to succeed again", timeout_s=30)
    assert service.alive(), f"the gateway must ride out the outage in the same process:\n{service.tail()}"


def test_a_submit_while_redis_is_down_is_refused_at_once_and_work_resumes_after(
    stack: LocalStack, service: Service
) -> None:
    with httpx.Client(base_url=service.url) as client:
        assert submits_succeed(client, "before"), "the deployment must work before the outage"
        stack.stop_redis()
        try:
            eventually_sync(
                lambda: readiness(client)[1].get("redis") is False, "/readyz to report Redis down", timeout_s=30
            )
            gauge = ready_gauge(client)
            assert gauge.get("redis") == 0, f"/metrics while Redis is down: {gauge}"
            refused_fast(client, "task store")
        finally:
            stack.start_redis()
        eventually_sync(
            lambda: readiness(client)[0] == 200, "/readyz to be ready again after Redis restarted", timeout_s=60
        )
        eventually_sync(
            lambda: set(ready_gauge(client).values()) == {1.0}, "/metrics to show every check passing", timeout_s=30
        )
        eventually_sync(lambda: submits_succeed(client, "after"), "submits to succeed again", timeout_s=30)
    assert service.alive(), f"the gateway must ride out the outage in the same process:\n{service.tail()}"
