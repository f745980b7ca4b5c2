"""``batchwire topics grow --batch-partitions`` on a running deployment, with real processes.

The roles keep running with the count they started with. A worker that owns a partition added by the
grow takes batches there, and a gateway started before the grow must see them: its admission reads a
model whose batches stop as stalled, and refuses its submits (503 ``overloaded``).
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cluster_checks import proc_named
from tests.support.eventually import eventually_sync
from tests.support.http_calls import many_at_once
from tests.support.processes import Cluster, launch

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

CALL_MS = 1500
"""Long enough that requests always wait for the next batch at the load below."""
SESSION_MS = 60_000
"""Far past the test: the frozen worker keeps its partition, so the other alone serves the model."""


def _owned(cluster: Cluster, name: str) -> str | None:
    found = re.findall(
        rf"worker {name} owns batch partitions \[([0-9, ]*)\]", (cluster.base / f"{name}.log").read_text()
    )
    return found[-1] if found else None


def test_a_gateway_started_before_a_grow_counts_the_batches_on_the_new_partitions(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    one_partition = {"BATCHWIRE_BATCH_PARTITIONS": "1"}
    session = ("--session-timeout-ms", str(SESSION_MS))
    cluster = launch(
        tmp_path,
        infra.kafka_bootstrap,
        infra.redis_url,
        workers=1,
        sim_latency_ms=CALL_MS,
        extra_env=one_partition,
        worker_args=session,
    )
    clusters.append(cluster)
    cluster.worker(1, *session)  # beyond the one partition: idle until the grow
    grown = subprocess.run(
        [sys.executable, "-m", "batchwire.cli", "topics", "grow", "--batch-partitions", "2"],
        env={
            **os.environ,
            "BATCHWIRE_NAMESPACE": cluster.namespace,
            "BATCHWIRE_KAFKA_BOOTSTRAP": cluster.kafka_bootstrap,
        },
        capture_output=True,
        text=True,
        check=False,
    )
    assert grown.returncode == 0, grown.stderr
    eventually_sync(
        lambda: {_owned(cluster, "worker0"), _owned(cluster, "worker1")} == {"0", "1"},
        "each worker to own one of the two partitions (the group's metadata refresh)",
        timeout_s=60,
    )
    eventually_sync(
        lambda: "over 2 partitions" in (cluster.base / "gateway0.log").read_text(),
        "the gateway to count the batches on both partitions (its own metadata refresh)",
        timeout_s=30,
    )
    # The worker on the old partition stops taking batches (frozen, still in the group): the other,
    # on the partition the grow added, serves the model alone.
    frozen = proc_named(cluster, "worker0" if _owned(cluster, "worker0") == "0" else "worker1")
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        refused = asyncio.run(_load(cluster.gateway_urls[0]))
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    stalled = [message for message in refused if "have taken none" in message]
    assert not stalled, (
        f"a worker served the model throughout; the gateway refused {len(stalled)} as stalled: {stalled[:2]}"
    )


async def _load(url: str) -> list[str]:
    """Ten requests a second for 12 s; the messages of the refused ones (a batch sent to the frozen
    worker ends its requests at their 10 s deadline, a 504)."""
    async with httpx.AsyncClient(timeout=60, limits=many_at_once(200)) as client:

        async def one(n: int) -> httpx.Response:
            return await client.post(f"{url}/v1/inference", json={"input": f"g{n}", "timeout_ms": 10_000})

        sent = []
        for n in range(120):
            sent.append(asyncio.create_task(one(n)))
            await asyncio.sleep(0.1)  # pacing the load, not synchronization
        responses = await asyncio.gather(*sent)
    codes = collections.Counter(r.status_code for r in responses)
    assert codes[200] > 60, f"the worker on the new partition answers most of the load: {codes}"
    return [r.json()["error"]["message"] for r in responses if r.status_code == 503]
