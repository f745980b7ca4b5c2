"""End to end through HTTP: the same tests against the embedded service and the Kafka deployment.

The Kafka deployment runs gateway, batcher and two workers as separate OS processes. Invariants
come from the workers' batch journals: no worker runs two batches at once, no batch exceeds 100,
every task runs exactly once, every answer belongs to its request.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import Counter, defaultdict
from typing import Any

import httpx
import pytest

from tests.support.e2e_system import System
from tests.support.http_calls import collect_events

pytestmark = pytest.mark.slow


def check_journal(system: System, task_ids: set[str]) -> list[dict[str, Any]]:
    """Asserts the batch invariants for ``task_ids``; returns the batches that carried them."""
    entries = system.journal()
    by_worker: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for entry in entries:
        by_worker[entry["worker"]].append((entry["start"], entry["end"]))
        assert entry["size"] <= 100, f"batch {entry['batch_id']} has {entry['size']} items (max 100)"
    for worker, spans in by_worker.items():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end, f"worker {worker} started a batch at {start} before its previous one ended at {end}"
    ran = Counter(task_id for entry in entries for task_id in entry["task_ids"] if task_id in task_ids)
    missing = task_ids - set(ran)
    assert not missing, f"{len(missing)} tasks never ran in any batch"
    twice = {task_id: n for task_id, n in ran.items() if n > 1}
    assert not twice, f"tasks ran more than once: {list(twice.items())[:5]}"
    return [entry for entry in entries if task_ids.intersection(entry["task_ids"])]


async def test_500_concurrent_sync_requests_each_get_their_own_answer(system: System) -> None:
    inputs = [f"req-{n}-{uuid.uuid4().hex[:6]}" for n in range(500)]
    limits = httpx.Limits(max_connections=600, max_keepalive_connections=600)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def one(n: int, text: str) -> httpx.Response:
            url = system.urls[n % len(system.urls)]
            return await client.post(f"{url}/v1/inference", json={"input": text})

        responses = await asyncio.gather(*(one(n, text) for n, text in enumerate(inputs)))
    bodies = [r.json() for r in responses]
    statuses = Counter(r.status_code for r in responses)
    assert statuses == {200: 500}, f"expected 500 answers, got {statuses}: {bodies[:3]}"
    for text, body in zip(inputs, bodies, strict=True):
        assert body["output"] == text[::-1], f"answer {body['output']!r} does not belong to input {text!r}"
        assert 1 <= body["batch_size"] <= 100
    task_ids = {body["task_id"] for body in bodies}
    assert len(task_ids) == 500, "every request gets its own task id"
    batches = check_journal(system, task_ids)
    assert max(entry["size"] for entry in batches) > 1, "concurrent requests should share batches"


async def test_async_task_is_delivered_by_poll_and_long_poll(system: System) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        url = system.urls[0]
        created = await client.post(f"{url}/v1/tasks", json={"input": "polled"})
        assert created.status_code == 202, created.text
        body = created.json()
        assert body["status"] == "queued"
        task_id = body["task_id"]
        started = time.monotonic()
        waited = await client.get(f"{url}/v1/result/{task_id}", params={"wait": 20})
        elapsed = time.monotonic() - started
        assert waited.status_code == 200
        assert waited.json()["status"] == "completed"
        assert waited.json()["output"] == "dellop"
        assert elapsed < 10, f"the long-poll must return when the task ends, not after the wait ({elapsed:.1f} s)"
        again = await client.get(f"{url}/v1/result/{task_id}")
        assert again.json()["output"] == "dellop"
        unknown = await client.get(f"{url}/v1/result/{uuid.uuid4().hex}")
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "task_not_found"
    check_journal(system, {task_id})


async def test_sse_streams_status_changes_and_closes_after_the_result(system: System) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        url = system.urls[-1]
        created = (await client.post(f"{url}/v1/tasks", json={"input": "streamed"})).json()
        events = await asyncio.wait_for(collect_events(client, url, created["task_id"]), 20)
    statuses = [name for name, _ in events]
    assert statuses[-1] == "completed", f"stream must end with the result, got {statuses}"
    assert events[-1][1]["output"] == "demaerts"
    assert len(statuses) == len(set(statuses)), f"no status repeats: {statuses}"
    order = ["queued", "batched", "running", "completed"]
    assert statuses == sorted(statuses, key=order.index), f"statuses only move forward: {statuses}"


async def test_late_sse_client_first_gets_the_current_state(system: System) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        url = system.urls[0]
        done = (await client.post(f"{url}/v1/inference", json={"input": "late"})).json()
        events = await asyncio.wait_for(collect_events(client, url, done["task_id"]), 20)
    assert [name for name, _ in events] == ["completed"]
    assert events[0][1]["output"] == "etal"


async def test_an_idle_worker_takes_a_lone_request_without_waiting_for_a_timer(system: System) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        latencies = []
        for n in range(5):
            started = time.monotonic()
            response = await client.post(f"{system.urls[0]}/v1/inference", json={"input": f"lone{n}"})
            latencies.append(time.monotonic() - started)
            assert response.json()["batch_size"] == 1
    # max_wait is 1 s by default; a lone request must go as soon as it arrives (generous bound).
    assert sorted(latencies)[2] < 0.6, f"median latency {sorted(latencies)[2]:.3f} s: a timer held the request"
