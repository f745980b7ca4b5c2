"""A gateway process held up (SIGSTOP: a paused container, a frozen VM, a long swap storm) past its
synchronous callers' deadlines while their tasks were answered in time: once it runs again, each
caller gets its answer, not ``deadline_exceeded`` for a task whose reply sat unread in its socket.

Real processes over the session's Kafka and Redis, real signals.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from schemas.records import TaskStatus
from schemas.wire import Names
from tests.support.cluster_checks import proc_named
from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster, launch, redis_client, task_states

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

CALLERS = 4
TIMEOUT_MS = 4000
"""Each caller's deadline: its task is answered well within it, and the gateway stays frozen past it."""


def _call(url: str, text: str) -> tuple[int, dict[str, Any]]:
    response = httpx.post(f"{url}/v1/inference", json={"input": text, "timeout_ms": TIMEOUT_MS}, timeout=60)
    return response.status_code, response.json()


@pytest.mark.parametrize("gateway_args", [(), ("--deterministic-models", "sim")], ids=["own", "collapsed"])
def test_a_gateway_frozen_past_its_callers_deadlines_answers_the_tasks_that_ended_in_time(
    tmp_path: Path, infra: Any, clusters: list[Cluster], gateway_args: tuple[str, ...]
) -> None:
    """Each caller's task on its own, and (a deterministic model) each one a collapsed computation."""
    # One batch of every caller's task, sealed at its size: its credit taken is every request published.
    cluster = launch(
        tmp_path,
        infra.kafka_bootstrap,
        infra.redis_url,
        workers=1,
        sim_latency_ms=100,
        gateway_args=gateway_args,
        batcher_args=("--policy", "classic", "--max-batch", str(CALLERS), "--max-wait-ms", "30000"),
    )
    clusters.append(cluster)
    url = cluster.gateway_urls[0]
    gateway, worker = proc_named(cluster, "gateway0"), proc_named(cluster, "worker0")
    credits = Names(cluster.namespace).credit_queue("sim")
    store = redis_client(cluster.redis_url)
    texts = [f"held-{index}" for index in range(CALLERS)]
    with ThreadPoolExecutor(max_workers=CALLERS) as pool:
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            calls = [pool.submit(_call, url, text) for text in texts]
            sent_at = time.monotonic()
            eventually_sync(lambda: store.zcard(credits) == 0, "the batch to be dispatched", timeout_s=10)
            os.kill(gateway.pid, signal.SIGSTOP)
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        try:
            eventually_sync(
                lambda: sum(len(batch["task_ids"]) for batch in cluster.journal()) >= CALLERS,
                "every caller's task to be computed",
                timeout_s=30,
                interval_s=0.01,
            )
            past_deadline_s = sent_at + TIMEOUT_MS / 1000 + 1 - time.monotonic()
            time.sleep(max(0.0, past_deadline_s))  # the fault's length, not a synchronisation
        finally:
            os.kill(gateway.pid, signal.SIGCONT)
        answers = [call.result() for call in calls]
    store.close()
    for text, (status, body) in zip(texts, answers, strict=True):
        assert status == 200 and body.get("output") == text[::-1], (
            f"a task answered before its deadline is answered once the gateway runs again: {status} {body}\n"
            f"{gateway.tail()}"
        )
    stored = task_states(cluster.redis_url, cluster.namespace, [body["task_id"] for _, body in answers])
    assert {state.status for state in stored.values()} == {TaskStatus.COMPLETED} and len(stored) == CALLERS, (
        f"each caller's task reads completed, as it was answered: {stored}"
    )
    computed = [task_id for batch in cluster.journal() for task_id in batch["task_ids"]]
    assert len(computed) == len(set(computed)) == CALLERS, f"each task computed once: {computed}"
