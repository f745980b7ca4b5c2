"""What the e2e tests read from a running cluster: stored states, process logs, terminal events;
and the two-batchers-one-slow-worker cluster built on them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition  # type: ignore[import-untyped, unused-ignore]
from aiokafka.admin import AIOKafkaAdminClient  # type: ignore[import-untyped, unused-ignore]

from infra.ports import free_port
from schemas.codec import decode_state
from schemas.records import TaskState, TaskStatus
from schemas.wire import Names
from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster, Proc, TerminalEvents, launch, redis_client, task_states


async def group_offsets(bootstrap: str, group: str, topic: str) -> tuple[dict[int, int], dict[int, int]]:
    """The group's committed offset (0 where none yet) and the end offset of each of ``topic``'s
    partitions, as the cluster tells them now."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await admin.start()
    await consumer.start()
    try:
        [described] = await admin.describe_topics([topic])
        partitions = [TopicPartition(topic, p["partition"]) for p in described["partitions"]]
        assert partitions, f"{topic} has partitions: {described}"
        committed = await admin.list_consumer_group_offsets(group)
        ends = await consumer.end_offsets(partitions)
    finally:
        await consumer.stop()
        await admin.close()
    return (
        {tp.partition: max(0, committed[tp].offset) if tp in committed else 0 for tp in partitions},
        {tp.partition: ends[tp] for tp in partitions},
    )


def stored(cluster: Cluster) -> dict[str, TaskState]:
    """Every task stored in the cluster's namespace, by id (in the order of their keys)."""
    client = redis_client(cluster.redis_url)
    try:
        keys = sorted(client.scan_iter(match=Names(cluster.namespace).task_key("*"), count=1000))
        docs = [client.hget(key, "doc") for key in keys]
        return {state.task_id: state for state in (decode_state(doc) for doc in docs if doc)}
    finally:
        client.close()


def running(cluster: Cluster) -> dict[str, str]:
    """Task id -> worker id of every task stored as running in the cluster's namespace."""
    return {
        task_id: state.worker_id
        for task_id, state in stored(cluster).items()
        if state.status is TaskStatus.RUNNING and state.worker_id
    }


def proc_named(cluster: Cluster, name: str) -> Proc:
    """The live incarnation of process ``name``."""
    return next(p for p in reversed(cluster.procs) if p.name == name and p.alive())


def logged(cluster: Cluster, name: str, text: str) -> int:
    """How many lines of process ``name``'s log contain ``text`` (all its incarnations)."""
    path = cluster.base / f"{name}.log"
    return sum(text in line for line in path.read_text(errors="replace").splitlines()) if path.exists() else 0


def batchers_settled(cluster: Cluster) -> None:
    """Waits until batcher1 joined and batcher0 got its share after the rebalance."""
    eventually_sync(
        lambda: (
            logged(cluster, "batcher1", "assigned request partitions") >= 1
            and logged(cluster, "batcher0", "assigned request partitions") >= 2
        ),
        "the second batcher to join the group",
        timeout_s=30,
    )


async def terminal_events(cluster: Cluster, events: TerminalEvents, task_ids: list[str]) -> dict[str, int]:
    """Waits (up to 15 s) for each task's terminal event; returns the tasks published more than once.

    On a timeout the failure names the tasks with no event and what the store holds for them.
    """
    try:
        await asyncio.to_thread(
            eventually_sync,
            lambda: all(task in events.states for task in task_ids),
            "every terminal event",
            timeout_s=15,
        )
    except AssertionError:
        missing = [task for task in task_ids if task not in events.states]
        stored = task_states(cluster.redis_url, cluster.namespace, missing)
        raise AssertionError(
            f"{len(missing)} task(s) without a terminal event (listener failure: {events.failure!r}); stored: {stored}"
        ) from None
    return events.twice()


async def two_batchers_one_slow_worker(tmp_path: Path, infra: Any, clusters: list[Cluster]) -> tuple[Cluster, int]:
    """Two batchers sharing the request partitions and one worker with one-second batches, so
    requests pile up in the batchers; returns the cluster and batcher0's metrics port."""
    port = free_port()
    cluster = launch(
        tmp_path,
        infra.kafka_bootstrap,
        infra.redis_url,
        workers=1,
        sim_latency_ms=1000,
        batcher_args=("--metrics-port", str(port)),
    )
    clusters.append(cluster)
    cluster.batcher(1)
    await asyncio.to_thread(batchers_settled, cluster)
    return cluster, port
