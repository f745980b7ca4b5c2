"""A retry whose Idempotency-Key names a task that was never stored: real processes over Kafka and Redis.

A submit can bind its key and end before it stores the task or sends its request: the answer to its
claim was lost with a Redis primary killed mid-command (the backbone chaos test lost such a task),
or its gateway was killed in between. The test binds keys in the cluster's Redis as such a submit
would have, then retries each through a real gateway: the retry names that task, sends it, and it
ends with its answer, computed once, the synchronous one long before the key would go stale.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.keys import idempotency
from gateway.keys.replay import UNSTORED_GRACE_S
from schemas.wire import IDEMPOTENCY_HEADER, Names
from tests.support.processes import Cluster, launch, stopped_after
from transport.redis.store import RedisTaskStore

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

BOUND_FOR_S = 60.0
"""The bound tasks' deadline: a retry that waited for one to go stale would time out first."""


@pytest.fixture
def cluster(tmp_path: Path, infra: Any, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with stopped_after(request, launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=1)) as started:
        yield started


async def _bind(cluster: Cluster, key: str, task_id: str, text: str) -> None:
    """Binds ``key`` to ``task_id`` as a submit of ``text`` does first, and stores nothing else."""
    store = RedisTaskStore(cluster.redis_url, Names(cluster.namespace))
    try:
        deadline_ms = int((time.time() + BOUND_FOR_S) * 1000)
        claim = await store.claim_key(
            idempotency.ANONYMOUS_SCOPE, key, task_id, idempotency.fingerprint(text, "sim"), deadline_ms
        )
        assert claim.task_id == task_id
        assert await store.get(task_id) is None
    finally:
        await store.close()


async def test_retries_of_bound_tasks_that_were_never_stored_send_them_and_they_end(cluster: Cluster) -> None:
    url = cluster.gateway_urls[0]
    await _bind(cluster, "lost-async", "bound-async", "queued once")
    await _bind(cluster, "lost-sync", "bound-sync", "waited for")
    async with httpx.AsyncClient(timeout=30) as client:
        accepted = await client.post(
            f"{url}/v1/tasks", json={"input": "queued once"}, headers={IDEMPOTENCY_HEADER: "lost-async"}
        )
        started = time.monotonic()
        answered = await client.post(
            f"{url}/v1/inference",
            json={"input": "waited for", "timeout_ms": 20_000},
            headers={IDEMPOTENCY_HEADER: "lost-sync"},
        )
        took_s = time.monotonic() - started
        polled = await client.get(f"{url}/v1/result/bound-async", params={"wait": 20})
        again = await client.post(
            f"{url}/v1/tasks", json={"input": "queued once"}, headers={IDEMPOTENCY_HEADER: "lost-async"}
        )

    assert (accepted.status_code, accepted.json()["task_id"]) == (202, "bound-async"), accepted.text
    assert accepted.headers["idempotent-replayed"] == "true"
    assert (polled.status_code, polled.json()["status"]) == (200, "completed"), polled.text
    assert polled.json()["output"] == "ecno deueuq"
    assert answered.status_code == 200, answered.text
    assert (answered.json()["task_id"], answered.json()["output"]) == ("bound-sync", "rof detiaw")
    assert took_s < UNSTORED_GRACE_S + 10, f"the synchronous retry took {took_s:.1f} s"
    assert (again.json()["task_id"], again.json()["status"]) == ("bound-async", "completed"), again.text
    runs = [task for entry in cluster.journal() for task in entry["task_ids"]]
    assert sorted(runs) == ["bound-async", "bound-sync"], f"each computed once: {runs}"
