"""A worker process frozen mid-call (SIGSTOP: a paused container, a frozen VM, a long swap storm) past
its hang limit, then resumed: the call ends as the process runs again, so the worker keeps serving and
answers the batch itself, once, instead of stopping as hung (exit 75) and leaving its model unserved.

Real processes over the session's Kafka and Redis, real signals. The worker's group session outlasts
the freeze, so its partitions stay with it and no rebalance takes part.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from infra.ports import free_port
from tests.support.cluster_checks import proc_named
from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster, launch, metric

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

CALL_MS = 800
"""The sim's call; configured as the expected latency, so the hang limit is known from the start."""
HANG_LIMIT_S = 1.6
"""``--hang-factor 2`` times the expected call."""
FROZEN_S = 5.0
"""The fault: over three hang limits, under the group session (60 s)."""


def test_a_worker_frozen_mid_call_past_its_hang_limit_answers_its_batch_once_it_runs_again(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    port = free_port()
    cluster = launch(
        tmp_path,
        infra.kafka_bootstrap,
        infra.redis_url,
        workers=1,
        sim_latency_ms=CALL_MS,
        worker_args=(
            "--expected-latency-ms",
            str(CALL_MS),
            "--hang-factor",
            str(HANG_LIMIT_S * 1000 / CALL_MS),
            "--hang-min-s",
            "1",
            "--session-timeout-ms",
            "60000",
            "--metrics-port",
            str(port),
        ),
    )
    clusters.append(cluster)
    url = cluster.gateway_urls[0]
    with httpx.Client(timeout=30) as client:
        submitted = client.post(f"{url}/v1/tasks", json={"input": "frozen", "timeout_ms": 30_000})
        assert submitted.status_code == 202, submitted.text
        task_id = submitted.json()["task_id"]

        eventually_sync(
            lambda: metric(port, "batchwire_worker_call_running_seconds") > 0,
            "the task's backend call to start",
            timeout_s=30,
            interval_s=0.02,
        )
        worker = proc_named(cluster, "worker0")
        frozen_at = time.monotonic()  # the journal's clock: one for every process on the host
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            time.sleep(FROZEN_S)  # the fault's length, not a synchronisation
        finally:
            resumed_at = time.monotonic()
            os.kill(worker.pid, signal.SIGCONT)
        result = client.get(f"{url}/v1/result/{task_id}", params={"wait": 20}).json()
    assert result.get("status") == "completed" and result.get("output") == "nezorf", (
        f"the frozen worker's call ends once it runs again, and answers: {result}\n{worker.tail()}"
    )
    assert worker.alive(), f"the worker stopped (exit {worker.popen and worker.popen.poll()}):\n{worker.tail()}"
    ran = [batch for batch in cluster.journal() if task_id in batch["task_ids"]]
    assert len(ran) == 1, f"the task ran once, on the worker that was frozen: {ran}"
    assert ran[0]["start"] < frozen_at and ran[0]["end"] > resumed_at, (
        f"the freeze landed mid-call (frozen {frozen_at:.3f}..{resumed_at:.3f}), or this tested nothing: {ran[0]}"
    )
