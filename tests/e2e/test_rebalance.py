"""A consumer group changes while batches run: a member joins the workers' group mid-call.

Real processes over the session's Kafka and Redis. Kafka's group protocol revokes every partition
of every member at a rebalance and hands each back at its committed offset, so a worker that keeps
the partition of the batch it is running fetches that batch again before it committed it: the
batch's results, stored once its call ends, end its tasks, and the second delivery runs none.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from schemas.wire import Names
from tests.support.cluster_checks import terminal_events
from tests.support.eventually import eventually
from tests.support.http_calls import assert_answered, post_stream
from tests.support.processes import Cluster, TerminalEvents, launch

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

CALL_MS = 2000
"""Long enough for a member to join and the group to settle while the batch's call runs."""


class Assigned(ConsumerRebalanceListener):  # type: ignore[misc]
    """When the joining member got its partitions, and which."""

    def __init__(self) -> None:
        self.partitions: set[int] | None = None
        self.at_s = 0.0

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        pass

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        self.partitions = {tp.partition for tp in assigned}
        self.at_s = time.monotonic()


async def test_a_batch_whose_worker_keeps_its_partition_through_a_rebalance_runs_once(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    cluster = launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=1, sim_latency_ms=CALL_MS)
    clusters.append(cluster)
    names = Names(cluster.namespace)
    inputs = [f"kept-{n}" for n in range(40)]
    # A lone worker offers its credits for its lowest partition, 0, so every batch comes there. The
    # joining member's client id sorts after the worker's ("batchwire-worker-..."): the round-robin
    # assignment leaves the worker partition 0, handed back at its committed offset.
    joiner = AIOKafkaConsumer(
        bootstrap_servers=cluster.kafka_bootstrap,
        group_id=names.worker_group("sim"),
        client_id="zz-joiner",
        enable_auto_commit=False,
        session_timeout_ms=10_000,
        heartbeat_interval_ms=1000,
    )
    assigned = Assigned()
    with TerminalEvents(cluster.redis_url, cluster.namespace) as events:
        sent = asyncio.create_task(post_stream(cluster.gateway_urls[0], inputs, 0.1))
        await eventually(lambda: bool(cluster.journal()), "a first call to end", timeout_s=30, interval_s=0.1)
        joiner.subscribe([names.batch_topic("sim")], listener=assigned)
        await joiner.start()
        try:
            await eventually(lambda: assigned.partitions is not None, "the joining member's partitions", timeout_s=30)
            responses = await sent
        finally:
            await joiner.stop()
        bodies = assert_answered(inputs, responses)
        twice = await terminal_events(cluster, events, [body["task_id"] for body in bodies])
    assert twice == {}, f"tasks answered twice: {twice}"
    assert assigned.partitions is not None and 0 not in assigned.partitions, (
        f"the joining member took the running batch's partition: {assigned.partitions}"
    )
    journal = cluster.journal()
    assert any(row["start"] < assigned.at_s < row["end"] for row in journal), "no call ran as the group settled"
    runs = Counter(task for row in journal for task in row["task_ids"])
    assert max(runs.values()) == 1, (
        f"each task runs once; the batch fetched again by the worker that ran it ran again: {journal}"
    )
