"""Writes that wait for replicas over a Redis Cluster: ``WAIT`` per primary, on the connection that wrote.

Over the session's cluster of three primaries, each with a replica (``replicated_cluster``), and over
the one without replicas (``redis_cluster``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis

from schemas.codec import decode_state
from schemas.records import TaskState, TaskStatus
from schemas.wire import Names
from transport.redis.store import RedisTaskStore

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]

WAIT_MS = 2_000


@pytest.fixture
def names() -> Names:
    return Names(f"wait-{uuid.uuid4().hex[:8]}")


@pytest.fixture
async def store(replicated_cluster: Any, names: Names) -> AsyncIterator[RedisTaskStore]:
    store = RedisTaskStore(replicated_cluster.url, names)
    await store.start()
    try:
        yield store
    finally:
        await store.close()


def state(task_id: str, status: TaskStatus, **fields: Any) -> TaskState:
    return TaskState(task_id, status, "sim", time.time_ns() // 1_000_000 + status.rank, 0, **fields)


def replicas_of(cluster: Any) -> list[redis.Redis]:
    """A client per replica node, reading (``READONLY``) the keys of the slots its primary serves."""
    clients = []
    for node in cluster.nodes:
        client = redis.Redis(port=node.port)
        if client.info("replication")["role"] == "slave":
            client.execute_command("READONLY")
            clients.append(client)
        else:
            client.close()
    return clients


async def test_every_primary_counts_its_replica(store: RedisTaskStore, redis_cluster: str, names: Names) -> None:
    assert await store.connected_replicas() == 1
    bare = RedisTaskStore(redis_cluster, names)
    await bare.start()
    try:
        assert await bare.connected_replicas() == 0, "a cluster without replicas has none to wait for"
    finally:
        await bare.close()


async def test_a_batch_over_every_primary_is_on_their_replicas_when_wait_answers(
    store: RedisTaskStore, replicated_cluster: Any, names: Names
) -> None:
    """Forty tasks fall on all three primaries; each primary's pipeline writes its share, a mark and
    ``WAIT``, and the replies still reach their gateway's channel."""
    ids = [f"t{n}-{uuid.uuid4().hex[:6]}" for n in range(40)]
    for task_id in ids:
        assert await store.create(state(task_id, TaskStatus.QUEUED, reply_to="g1"))
    replies: list[TaskState] = []
    all_in = asyncio.Event()

    def on_reply(reply: TaskState) -> None:
        replies.append(reply)
        if len(replies) == len(ids):
            all_in.set()

    await store.listen_replies("g1", on_reply)
    done = [state(task_id, TaskStatus.COMPLETED, output=task_id[::-1], reply_to="g1") for task_id in ids]

    acked = await store.apply_replicated(done, 1, WAIT_MS)

    assert acked == 1, "every primary's replica acknowledged its share"
    await asyncio.wait_for(all_in.wait(), 5)
    assert sorted(reply.task_id for reply in replies) == sorted(ids), "one reply per task, on the gateway's channel"
    on_replicas: dict[str, TaskState] = {}
    for client in replicas_of(replicated_cluster):
        with client:
            for task_id in ids:
                try:
                    doc = client.hget(names.task_key(task_id), "doc")
                except redis.exceptions.MovedError:
                    continue  # another primary's slot
                if doc is not None:
                    on_replicas[task_id] = decode_state(doc)
    assert {task_id: s.status for task_id, s in on_replicas.items()} == dict.fromkeys(ids, TaskStatus.COMPLETED), (
        "WAIT answered: each task's end is on its primary's replica"
    )


async def test_a_mark_in_the_tasks_slot_makes_wait_cover_an_update_already_applied(
    store: RedisTaskStore, replicated_cluster: Any, names: Names
) -> None:
    task_id = f"again-{uuid.uuid4().hex[:6]}"
    await store.create(state(task_id, TaskStatus.QUEUED))
    completed = state(task_id, TaskStatus.COMPLETED, output="x")
    assert await store.apply([completed]) == [True]

    assert await store.apply_replicated([completed], 1, WAIT_MS) == 1
    marks = []
    for node in replicated_cluster.nodes:
        with redis.Redis(port=node.port) as client:
            if client.info("replication")["role"] == "master":
                try:
                    marks.append(client.exists(names.replication_mark_of(task_id)))
                except redis.exceptions.MovedError:
                    marks.append(-1)  # the slot is another primary's
    assert sorted(marks) == [-1, -1, 1], "the mark was written, on the primary that holds the task"
