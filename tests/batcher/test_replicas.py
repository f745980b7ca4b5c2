"""--redis-min-replicas for the batcher, against real Redis servers: a request the batcher ends is
committed only once a replica holds its end state.

A failover promotes a replica that may lack what the primary acknowledged last. Were an expired (or
unknown-model) request committed on the primary's word alone, the promoted replica would show it
``queued`` with nobody left to end it. Each test runs its own redis-server (a lone primary, so one
required replica keeps every store short), a replica started mid-test, and a batcher over an
in-memory request bus whose lag counts the uncommitted requests.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from batcher.service import Batcher
from batcher.settings import BatcherSettings
from infra.redis_server import RedisServer
from schemas.records import InferenceRequest, TaskState, TaskStatus
from schemas.wire import Names
from tests.support.eventually import eventually
from transport.memory.batches import MemoryBatchBus
from transport.memory.credits import MemoryCreditPool
from transport.memory.requests import MemoryRequestBus
from transport.redis.store import RedisTaskStore
from transport.replicas import ReplicaSettings, ReplicaWait
from transport.routing import Partitioner

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]  # their own redis-server processes

WAIT_MS = 50


def _status(port: int, key: str) -> bytes | None:
    with redis.Redis(port=port) as client:
        status: bytes | None = client.hget(key, "status")
    return status


@pytest.mark.parametrize(
    ("model", "deadline_ms", "ended"),
    [("sim", 50, TaskStatus.EXPIRED), ("ghost", 600_000, TaskStatus.FAILED)],
    ids=["expired", "unknown-model"],
)
async def test_a_request_the_batcher_ends_is_committed_only_once_a_replica_holds_its_end(
    primary: RedisServer,
    store: RedisTaskStore,
    names: Names,
    tmp_path: Path,
    model: str,
    deadline_ms: int,
    ended: TaskStatus,
) -> None:
    bus = MemoryRequestBus(Partitioner(("sim",), 1))
    wait = ReplicaWait(store, ReplicaSettings(min_replicas=1, wait_ms=WAIT_MS), "b1", role="batcher", retry_max_s=0.05)
    settings = BatcherSettings(models=("sim",), retry_max_s=0.05)
    batcher = Batcher(settings, bus.consumer(), MemoryBatchBus(1), MemoryCreditPool(), store, replicas=wait)
    now = int(time.time() * 1000)
    await store.create(TaskState("t1", TaskStatus.QUEUED, model, now, now))
    key = names.task_key("t1")
    await batcher.start()
    replica: RedisServer | None = None
    try:
        # No worker offers a credit: "sim" expires in the batcher; nobody serves "ghost".
        await bus.producer().send(InferenceRequest("t1", model, "x", now, now + deadline_ms, "gw"))
        await eventually(lambda: wait.short_stores >= 2, "stores that no replica acknowledged, tried again")
        assert _status(primary.port, key) == ended.value.encode(), "the end is stored on the primary"
        assert bus.lag() == 1, "a request whose end only the primary holds stays uncommitted"
        assert batcher.healthy(), "waiting for a replica is no failure"

        with redis.Redis(port=primary.port) as client:
            client.config_set("repl-diskless-sync-delay", 0)  # the replica's first sync starts at once
        replica = RedisServer(tmp_path / "replica", replica_of=primary.port)
        replica.start()
        await eventually(lambda: bus.lag() == 0, "the request to be committed once a replica holds its end")
        assert _status(replica.port, key) == ended.value.encode(), "the replica holds the end state"
    finally:
        await batcher.close()
        if replica is not None:
            replica.stop()
