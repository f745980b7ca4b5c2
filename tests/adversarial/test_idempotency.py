"""An Idempotency-Key whose task ended without being computed (expired, cancelled) starts a new task
on retry, in both modes; a computed task's key still replays it.

One sim worker with 1 s calls: a filler task holds it, so a keyed task waits long enough to expire
(a short ``timeout_ms``) or to be cancelled (DELETE) before any worker takes it.
"""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from typing import Any

import httpx
import pytest

from tests.support.adversarial_rig import Service, ServiceFactory
from tests.support.eventually import eventually_sync

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CALL_MS = 2000.0
"""Long enough that a task queued behind the filler is still queued when the test cancels it, on a busy machine."""


def _key() -> dict[str, str]:
    return {"Idempotency-Key": f"adv-{uuid.uuid4()}"}


def _occupy_the_worker(client: httpx.Client) -> str:
    """A filler task for the only worker; returns once it runs (so what comes next waits)."""
    filler = client.post("/v1/tasks", json={"input": f"filler-{uuid.uuid4().hex[:6]}"})
    assert filler.status_code == 202, filler.text
    task_id: str = filler.json()["task_id"]
    eventually_sync(
        lambda: _status(client, task_id) in ("running", "completed"), "the filler task to run", timeout_s=20
    )
    return task_id


def _status(client: httpx.Client, task_id: str) -> str:
    response = client.get(f"/v1/result/{task_id}")
    assert response.status_code == 200, response.text
    status: str = response.json()["status"]
    return status


def _error(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


def test_a_key_whose_task_expired_or_was_cancelled_starts_anew_on_retry(service_factory: ServiceFactory) -> None:
    service: Service = service_factory(workers=1, sim_latency_ms=CALL_MS)
    with httpx.Client(base_url=service.url, timeout=30) as client:
        # Expired: a 300 ms deadline behind a 2 s call ends expired, its sync caller told 504.
        _occupy_the_worker(client)
        key = _key()
        body = {"input": "expire-then-retry", "timeout_ms": 300}
        first = client.post("/v1/inference", json=body, headers=key)
        assert first.status_code == 504, first.text
        expired_id = _error(first)["task_id"]
        eventually_sync(lambda: _status(client, expired_id) == "expired", "the first task to end expired", timeout_s=20)

        started = time.monotonic()
        retry = client.post("/v1/inference", json={**body, "timeout_ms": 10_000}, headers=key)
        assert retry.status_code == 200, f"a retry with a longer timeout_ms must be computed: {retry.text}"
        assert time.monotonic() - started >= CALL_MS / 1000 * 0.9, "the retry was not computed anew"
        assert retry.json()["task_id"] != expired_id
        assert retry.json()["output"] == body["input"][::-1]
        assert "idempotent-replayed" not in retry.headers
        replay = client.post("/v1/inference", json={**body, "timeout_ms": 10_000}, headers=key)
        assert (replay.status_code, replay.json()["task_id"]) == (200, retry.json()["task_id"])
        assert replay.headers.get("idempotent-replayed") == "true", "a computed task's key replays it"

        # Cancelled: a DELETE while it waits behind the filler; retries racing each other share one new task.
        _occupy_the_worker(client)
        key = _key()
        body = {"input": "cancel-then-retry"}
        queued = client.post("/v1/tasks", json=body, headers=key)
        assert queued.status_code == 202, queued.text
        cancelled_id = queued.json()["task_id"]
        cancelled = client.delete(f"/v1/result/{cancelled_id}")
        assert (cancelled.status_code, cancelled.json()["status"]) == (200, "cancelled"), cancelled.text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # eight retries at once, each its own connection
        answers = list(pool.map(lambda _: _post(service.url, "/v1/inference", body, key), range(8)))
    assert {a.status_code for a in answers} == {200}, (
        f"a cancelled task's key must not answer 409: {[a.text for a in answers]}"
    )
    new_ids = {a.json()["task_id"] for a in answers}
    assert len(new_ids) == 1 and cancelled_id not in new_ids, f"expected one new task, got {new_ids}"
    assert {a.json()["output"] for a in answers} == {body["input"][::-1]}


def _post(url: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=30) as client:
        return client.post(path, json=body, headers=headers)
