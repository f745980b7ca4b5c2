"""A task cancelled while it waits never reaches the GPU (over Kafka and Redis, real processes)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cluster_checks import logged
from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster, launch, stopped_after, task_states

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


@pytest.fixture
def cluster(tmp_path: Path, infra: Any, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with stopped_after(
        request, launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=1, sim_latency_ms=3000)
    ) as started:
        yield started


async def test_a_cancelled_task_is_never_run(cluster: Cluster) -> None:
    url = cluster.gateway_urls[0]
    async with httpx.AsyncClient(timeout=30) as client:
        busy = (await client.post(f"{url}/v1/tasks", json={"input": "keeps the worker busy"})).json()["task_id"]
        await asyncio.to_thread(
            eventually_sync,
            lambda: any(busy in e["task_ids"] for e in cluster.journal()) or _running(cluster, busy),
            "the first task to start",
            timeout_s=20,
        )
        doomed = (await client.post(f"{url}/v1/tasks", json={"input": "never run me"})).json()["task_id"]
        kept = (await client.post(f"{url}/v1/tasks", json={"input": "run me"})).json()["task_id"]
        cancelled = await client.delete(f"{url}/v1/result/{doomed}")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
        done = await client.get(f"{url}/v1/result/{kept}", params={"wait": 20})
        assert done.json()["status"] == "completed", done.text
        after = (await client.get(f"{url}/v1/result/{doomed}")).json()
    assert after["status"] == "cancelled", f"the cancel stands after the batch ran: {after}"
    ran = {task for entry in cluster.journal() for task in entry["task_ids"]}
    assert kept in ran and doomed not in ran, "the cancelled task never reached the backend"
    assert logged(cluster, "worker0", "already ended") == 1, "the worker dropped it when it came in the batch"


def _running(cluster: Cluster, task_id: str) -> bool:

    state = task_states(cluster.redis_url, cluster.namespace, [task_id]).get(task_id)
    return state is not None and state.status.value == "running"


async def test_a_synchronous_task_running_past_its_504_is_not_cancellable(cluster: Cluster) -> None:
    """The 504 records the task ``queued`` (a synchronous task's ``running`` is not written): a DELETE
    then must not answer that a task the GPU is running was cancelled before a worker ran it. The fresh
    worker has timed no call, so it starts the task whatever its deadline, and its call takes 3 s."""
    url = cluster.gateway_urls[0]
    async with httpx.AsyncClient(timeout=30) as client:
        late = await client.post(f"{url}/v1/inference", json={"input": "runs past its 504", "timeout_ms": 1500})
        assert late.status_code == 504, f"an idle worker took the task and its call hangs: {late.text}"
        task_id = late.json()["error"]["task_id"]
        response = await client.delete(f"{url}/v1/result/{task_id}")
        after = (await client.get(f"{url}/v1/result/{task_id}")).json()
    assert response.status_code == 409, f"a DELETE of a task its worker is running: {response.text}"
    assert response.json()["error"]["code"] == "not_cancellable", response.text
    assert after["status"] != "cancelled", f"the DELETE changed the task: {after}"
