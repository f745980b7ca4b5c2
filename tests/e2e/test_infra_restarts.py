"""Kafka and Redis restarted under load: services reconnect by themselves; each request in that window
completes or gets a clear 503 (``unavailable``); ``/readyz`` is 503 during the outage and 200 after.

These tests run over a PRIVATE Kafka broker and Redis server (``LocalStack``), so restarting them
never disturbs other tests that share the session's infrastructure.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from infra.local_stack import LocalStack
from tests.support.http_calls import many_at_once
from tests.support.processes import Cluster, private_cluster

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timing]


@pytest.fixture
def cluster(private_stack: LocalStack, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    yield from private_cluster(request, private_stack, tmp_path, workers=2, sim_latency_ms=50)


@dataclass
class Outcome:
    sent_at: float
    took_s: float
    status: int
    code: str | None
    correct: bool


async def load(url: str, stop: asyncio.Event, rate_per_s: float, outcomes: list[Outcome]) -> None:
    """Open-loop sync requests at ``rate_per_s`` until ``stop``; every outcome recorded."""
    async with httpx.AsyncClient(timeout=40, limits=many_at_once(500)) as client:

        async def one(n: int) -> None:
            text = f"outage-{n}"
            started = time.monotonic()
            try:
                response = await client.post(f"{url}/v1/inference", json={"input": text, "timeout_ms": 30_000})
            except httpx.HTTPError as err:
                outcomes.append(Outcome(started, time.monotonic() - started, 0, type(err).__name__, False))
                return
            body = response.json()
            code = body.get("error", {}).get("code") if response.status_code != 200 else None
            correct = response.status_code == 200 and body.get("output") == text[::-1]
            outcomes.append(Outcome(started, time.monotonic() - started, response.status_code, code, correct))

        tasks = []
        n = 0
        while not stop.is_set():
            tasks.append(asyncio.create_task(one(n)))
            n += 1
            await asyncio.sleep(1 / rate_per_s)  # pacing the load, not synchronization
        await asyncio.gather(*tasks)


async def readiness(url: str, stop: asyncio.Event, seen: list[tuple[float, int]], probed: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=3) as client:
        while not stop.is_set():
            try:
                status = (await client.get(f"{url}/readyz")).status_code
            except httpx.HTTPError:
                status = 0
            seen.append((time.monotonic(), status))
            probed.set()
            await asyncio.sleep(0.1)  # sampling rate of the probe


async def outage(
    cluster: Cluster, stop_service: Callable[[], None], start_service: Callable[[], None], label: str
) -> None:
    url = cluster.gateway_urls[0]
    stop = asyncio.Event()
    outcomes: list[Outcome] = []
    probes: list[tuple[float, int]] = []
    loader = asyncio.create_task(load(url, stop, 20, outcomes))
    probed = asyncio.Event()
    prober = asyncio.create_task(readiness(url, stop, probes, probed))

    async def until_probe(check: Callable[[], bool], timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while not check():
                probed.clear()
                await probed.wait()

    await asyncio.sleep(2)  # steady load before the fault
    down_at = time.monotonic()
    await asyncio.to_thread(stop_service)
    await until_probe(lambda: any(t > down_at and s != 200 for t, s in probes), 30)
    await asyncio.sleep(3)  # the outage lasts: requests keep coming
    await asyncio.to_thread(start_service)
    up_at = time.monotonic()
    # readiness back, then a few seconds of load after it
    await until_probe(lambda: probes[-1][0] > up_at and probes[-1][1] == 200, 60)
    ready_at = next(t for t, s in probes if t > up_at and s == 200)
    await asyncio.sleep(3)
    stop.set()
    await asyncio.gather(loader, prober)

    statuses = Counter((o.status, o.code) for o in outcomes)
    wrong = [o for o in outcomes if o.status == 200 and not o.correct]
    unclear = [o for o in outcomes if o.status not in (200, 503) or (o.status == 503 and o.code != "unavailable")]
    during = [s for t, s in probes if down_at <= t <= up_at]
    after = [o for o in outcomes if o.sent_at > ready_at]
    first_ok_after = min(
        (o.sent_at + o.took_s for o in outcomes if o.sent_at > up_at and o.status == 200), default=None
    )
    print(
        f"\n{label}: {len(outcomes)} requests {dict(statuses)}; down for {up_at - down_at:.1f} s; "
        f"/readyz 200 again {ready_at - up_at:.1f} s after; first answer after the restart "
        f"{(first_ok_after - up_at) if first_ok_after else float('nan'):.1f} s after it"
    )
    assert not wrong, f"answers that do not match their input: {wrong[:3]}"
    assert not unclear, (
        f"every request completes or gets 503 unavailable, got {Counter((o.status, o.code) for o in unclear)}"
    )
    assert 503 in during or 0 in during, f"/readyz must say 503 while {label} is down, saw {Counter(during)}"
    assert after and all(o.status == 200 for o in after), (
        f"requests sent once ready again must complete: {Counter((o.status, o.code) for o in after)}"
    )
    for proc in cluster.procs:
        assert proc.alive(), f"{proc.name} died during the {label} outage:\n{proc.tail()}"


async def test_a_kafka_restart_under_load(private_stack: LocalStack, cluster: Cluster) -> None:
    await outage(cluster, private_stack.stop_kafka, private_stack.start_kafka, "Kafka outage")


async def test_a_redis_restart_under_load(private_stack: LocalStack, cluster: Cluster) -> None:
    await outage(cluster, private_stack.stop_redis, private_stack.start_redis, "Redis outage (its data is lost)")
