"""--redis-min-replicas against real Redis servers: a batch is committed only once replicas hold its results.

Each test runs its own redis-server (a lone primary; a replica is started where a test needs one)
and a worker over in-memory batches and credits whose commits are recorded, with a real
``RedisTaskStore`` and ``ReplicaWait``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis as AsyncRedis

from gpu_worker.settings import WorkerSettings
from gpu_worker.worker import Worker
from infra.redis_server import RedisServer
from schemas.codec import decode_state
from schemas.records import Batch, TaskState, TaskStatus
from schemas.wire import Names
from tests.support.eventually import eventually
from tests.support.sentinels import MASTER, SentinelCluster
from tests.support.task_states import state
from tests.support.worker_rig import Rig, ScriptedBackend, now_ms
from transport.memory.batches import MemoryBatchConsumer
from transport.memory.store import MemoryTaskStore
from transport.ports import Delivered
from transport.redis.store import RedisTaskStore
from transport.replicas import ReplicaSettings, ReplicaWait, parse_min_replicas

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]  # their own redis-server processes

WAIT_MS = 50


class RecordingConsumer(MemoryBatchConsumer):
    """Records every commit (the in-memory consumer's commit does nothing)."""

    def __init__(self, inner: MemoryBatchConsumer) -> None:
        super().__init__(inner.bus, inner.partition)
        self.committed: list[Delivered[Batch]] = []

    async def commit(self, delivered: Delivered[Batch]) -> None:
        self.committed.append(delivered)


async def _worker(rig: Rig, store: RedisTaskStore, settings: ReplicaSettings) -> tuple[Worker, RecordingConsumer]:
    consumer = RecordingConsumer(rig.bus.consumer(0))
    replicas = ReplicaWait(store, settings, "w1", retry_max_s=0.05)
    worker = Worker(
        WorkerSettings(worker_id="w1", retry_max_s=0.05),
        consumer,
        rig.credits,
        store,
        ScriptedBackend(),
        deliveries=rig.deliveries,
        replicas=replicas,
    )
    await worker.start()
    return worker, consumer


async def _send(rig: Rig, store: RedisTaskStore, inputs: list[str]) -> Batch:
    batch = rig.batch(inputs)
    for item in batch.items:
        await store.create(TaskState(item.task_id, TaskStatus.QUEUED, "sim", now_ms(), item.enqueued_at_ms))
    await rig.send(batch)
    return batch


def test_min_replicas_is_auto_or_a_count() -> None:
    assert parse_min_replicas("auto") is None and parse_min_replicas(" AUTO ") is None
    assert parse_min_replicas("2") == 2
    with pytest.raises(ValueError, match="BATCHWIRE_REDIS_MIN_REPLICAS"):
        ReplicaSettings(min_replicas=-1)
    with pytest.raises(ValueError, match="BATCHWIRE_REDIS_REPLICA_WAIT_MS"):
        ReplicaSettings(wait_ms=0)


async def test_auto_with_a_lone_redis_needs_no_replica_and_commits_at_once(store: RedisTaskStore) -> None:
    rig = Rig()
    worker, consumer = await _worker(rig, store, ReplicaSettings(wait_ms=WAIT_MS))
    assert worker.replicas is not None
    assert await store.connected_replicas() == 0
    assert await worker.replicas.required() == 0, "auto asks for no replica of a primary that has none"
    batch = await _send(rig, store, ["lone"])

    await eventually(lambda: len(consumer.committed) == 1, "the batch to be committed")
    await worker.close()

    state = await store.get(batch.items[0].task_id)
    assert state is not None and (state.status, state.output) == (TaskStatus.COMPLETED, "enol"), state
    assert worker.replicas.short_stores == 0


async def test_one_replica_required_of_a_lone_redis_keeps_the_batch_uncommitted_and_stores_again(
    store: RedisTaskStore,
) -> None:
    rig = Rig()
    worker, consumer = await _worker(rig, store, ReplicaSettings(min_replicas=1, wait_ms=WAIT_MS))
    assert worker.replicas is not None
    batch = await _send(rig, store, ["alone"])

    await eventually(lambda: worker.replicas is not None and worker.replicas.short_stores >= 3, "three short stores")
    state = await store.get(batch.items[0].task_id)
    assert state is not None and state.output == "enola", "the results are stored while they wait for a replica"
    assert consumer.committed == [], "a batch whose results no replica holds is not committed"
    assert worker.replicas.waiting and worker.healthy()
    for _ in range(500):  # the credit offered while the batch ran is taken back (within 5 s)
        if not await rig.credits.idle("sim"):
            break
        await asyncio.sleep(0.01)
    shorts = worker.replicas.short_stores
    await eventually(lambda: worker.replicas is not None and worker.replicas.short_stores >= shorts + 2, "more tries")
    assert await rig.credits.idle("sim") == 0, "no credit is offered while results wait for replicas"
    closing = time.monotonic()
    await worker.close()  # the drain timeout (30 s) is not waited out for replicas
    assert time.monotonic() - closing < 10, "close hands the batch back after its next short store"
    assert consumer.committed == [], "closing gives the unreplicated batch back uncommitted"
    assert worker.failure is None, f"handing back an unreplicated batch is no failure: {worker.failure!r}"


async def test_results_lost_before_a_replica_held_them_are_stored_again_and_committed_once_replicated(
    primary: RedisServer, store: RedisTaskStore, names: Names, tmp_path: Path
) -> None:
    rig = Rig()
    worker, consumer = await _worker(rig, store, ReplicaSettings(min_replicas=1, wait_ms=WAIT_MS))
    assert worker.replicas is not None
    batch = await _send(rig, store, ["kept"])
    task_key = names.task_key(batch.items[0].task_id)
    await eventually(lambda: worker.replicas is not None and worker.replicas.short_stores >= 1, "a short store")
    with redis.Redis(port=primary.port) as client:
        assert client.delete(task_key) == 1, "the result was on the primary"  # as a failover to a replica without it
        client.config_set("repl-diskless-sync-delay", 0)  # the replica's first sync starts at once

    replica = RedisServer(tmp_path / "replica", replica_of=primary.port)
    replica.start()
    try:
        await eventually(lambda: len(consumer.committed) == 1, "the batch to be committed once a replica holds it")
        await worker.close()
        assert await store.connected_replicas() == 1, "the replica, in sync, is counted"
        with redis.Redis(port=replica.port) as client:
            stored = client.hget(task_key, "status")
        assert stored == TaskStatus.COMPLETED.value.encode(), f"the replica holds the result stored again: {stored!r}"
        assert consumer.committed[0].offset == 0
    finally:
        replica.stop()


async def test_a_mark_makes_wait_cover_an_update_already_applied(store: RedisTaskStore, names: Names) -> None:
    batch = await _send(Rig(), store, ["twice"])
    state = await store.get(batch.items[0].task_id)
    assert state is not None
    completed = replace(state, status=TaskStatus.COMPLETED, updated_at_ms=state.updated_at_ms + 1, output="x")
    assert await store.apply([completed]) == [True]

    acked = await asyncio.wait_for(store.apply_replicated([completed], 0, WAIT_MS), 5)

    assert acked == 0, "no replica: WAIT 0 answers at once with none"
    with redis.Redis.from_url(store.redis_url) as client:
        assert client.exists(names.replication_mark) == 1, "the mark is written although the update was a no-op"


def _script_calls(client: redis.Redis) -> tuple[int, int, int]:
    """(EVALSHA, SCRIPT EXISTS, SCRIPT LOAD) calls the server has counted."""
    stats = client.info("commandstats")
    return tuple(  # type: ignore[return-value]
        int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "script|exists", "script|load")
    )


async def test_a_replicated_store_is_one_round_trip_and_loads_its_script_only_when_missing(
    primary: RedisServer, store: RedisTaskStore
) -> None:
    batch = await _send(Rig(), store, ["first", "second"])
    first, second = [await store.get(item.task_id) for item in batch.items]
    assert first is not None and second is not None
    done = [
        replace(s, status=TaskStatus.COMPLETED, updated_at_ms=s.updated_at_ms + 1, output="y") for s in (first, second)
    ]
    with redis.Redis(port=primary.port) as client:
        client.script_flush()  # a primary that never ran the script (as a failover's new one)
        before = _script_calls(client)
        assert await store.apply_replicated(done[:1], 0, WAIT_MS) == 0
        evalsha, exists, load = (after - was for after, was in zip(_script_calls(client), before, strict=True))
        assert (evalsha, exists, load) == (2, 0, 1), "NOSCRIPT: the script is loaded and the pipeline sent again"

        before = _script_calls(client)
        assert await store.apply_replicated(done[1:], 0, WAIT_MS) == 0
        evalsha, exists, load = (after - was for after, was in zip(_script_calls(client), before, strict=True))
        assert (evalsha, exists, load) == (1, 0, 0), "EVALSHA in the pipeline, no SCRIPT EXISTS before it"
    stored = await store.get_many([item.task_id for item in batch.items])
    assert [stored[item.task_id].status for item in batch.items] == [TaskStatus.COMPLETED] * 2, stored


async def test_a_replica_still_taking_its_first_copy_is_not_counted(
    primary: RedisServer, store: RedisTaskStore, tmp_path: Path
) -> None:
    with redis.Redis(port=primary.port) as client:
        client.config_set("repl-diskless-sync-delay", 2)  # the first copy starts 2 s after the replica asks
        replica = RedisServer(tmp_path / "replica", replica_of=primary.port)
        replica.start()
        try:
            await eventually(lambda: client.info("replication")["connected_slaves"] == 1, "the replica to connect")
            assert await store.connected_replicas() == 0, client.info("replication")
            assert await ReplicaWait(store, ReplicaSettings(), "w1").required() == 0

            for _ in range(500):  # within 10 s
                if await store.connected_replicas() == 1:
                    break
                await asyncio.sleep(0.02)
            assert await ReplicaWait(store, ReplicaSettings(), "w1").required() == 1, "in sync, it is counted"
        finally:
            replica.stop()


class ReplicatedMemoryStore(MemoryTaskStore):
    """The in-memory store with replicas that acknowledge every update except those of ``unreplicated`` tasks."""

    def __init__(self, unreplicated: set[str]) -> None:
        super().__init__()
        self.unreplicated = unreplicated

    async def connected_replicas(self) -> int:
        return 1

    async def apply_replicated(self, updates: Sequence[TaskState], replicas: int, timeout_ms: int) -> int:
        await self.apply(updates)
        return 0 if any(state.task_id in self.unreplicated for state in updates) else replicas


async def test_a_batch_after_one_handed_back_unreplicated_is_not_committed() -> None:
    rig = Rig()
    store = ReplicatedMemoryStore(unreplicated={"first"})
    consumer = RecordingConsumer(rig.bus.consumer(0))
    replicas = ReplicaWait(store, ReplicaSettings(min_replicas=1, wait_ms=WAIT_MS), "w1", retry_max_s=0.05)
    worker = Worker(
        WorkerSettings(worker_id="w1", retry_max_s=0.05),
        consumer,
        rig.credits,
        store,
        ScriptedBackend(),
        deliveries=rig.deliveries,
        replicas=replicas,
    )
    await worker.start()
    first, second = rig.batch(["one"], "b1"), rig.batch(["two"], "b2")
    first = replace(first, items=(replace(first.items[0], task_id="first"),))
    for batch in (first, second):
        for item in batch.items:
            await store.create(TaskState(item.task_id, TaskStatus.QUEUED, "sim", now_ms(), item.enqueued_at_ms))
        await rig.send(batch)
    await eventually(lambda: worker.batches_run == 2 and replicas.short_stores >= 1, "both run, the first short")

    await worker.close()

    stored = await store.get_many(["first", "t0"])
    assert {task_id: state.status for task_id, state in stored.items()} == {
        "first": TaskStatus.COMPLETED,
        "t0": TaskStatus.COMPLETED,
    }, "both batches' results are stored"
    assert consumer.committed == [], "the second batch's commit would have committed the first, unreplicated"


async def test_a_task_an_earlier_delivery_ended_is_stored_again_with_the_batch(
    primary: RedisServer, store: RedisTaskStore, names: Names, tmp_path: Path
) -> None:
    rig = Rig()
    backend = ScriptedBackend()
    consumer = RecordingConsumer(rig.bus.consumer(0))
    replicas = ReplicaWait(store, ReplicaSettings(min_replicas=1, wait_ms=WAIT_MS), "w2", retry_max_s=0.05)
    worker = Worker(
        WorkerSettings(worker_id="w2", retry_max_s=0.05),
        consumer,
        rig.credits,
        store,
        backend,
        deliveries=rig.deliveries,
        replicas=replicas,
    )
    await worker.start()
    batch = rig.batch(["done before"])
    item = batch.items[0]
    await store.create(TaskState(item.task_id, TaskStatus.QUEUED, "sim", now_ms(), item.enqueued_at_ms))
    answered = TaskState(item.task_id, TaskStatus.COMPLETED, "sim", now_ms(), item.enqueued_at_ms, output="answer")
    assert await store.apply([answered]) == [True]  # by the worker that died before committing
    await rig.send(batch)
    await eventually(lambda: replicas.short_stores >= 1, "a short store of the redelivered batch")
    with redis.Redis(port=primary.port) as client:
        assert client.delete(names.task_key(item.task_id)) == 1  # as a failover to a replica without it
        client.config_set("repl-diskless-sync-delay", 0)

    replica = RedisServer(tmp_path / "replica", replica_of=primary.port)
    replica.start()
    try:
        await eventually(lambda: len(consumer.committed) == 1, "the batch to be committed once a replica holds it")
        await worker.close()
        with redis.Redis(port=replica.port) as client:
            doc = client.hget(names.task_key(item.task_id), "doc")
    finally:
        replica.stop()
    assert doc is not None, "the ended task's state was stored again"
    kept = decode_state(doc)
    assert (kept.status, kept.output) == (TaskStatus.COMPLETED, "answer"), kept
    assert backend.calls == [], "an ended task is not run again"


@pytest.mark.timeout(120)
async def test_auto_behind_sentinel_commits_no_result_that_a_gracefully_failed_over_primary_drops(
    tmp_path: Path, names: Names
) -> None:
    """``SENTINEL FAILOVER`` leaves the old primary up until the Sentinels demote it: asked after a short
    ``WAIT``, it counts no replica (its own was promoted), so ``auto`` trusted it and committed results
    that it dropped once demoted. Now the count comes only from a primary the Sentinels confirm."""
    cluster = SentinelCluster(tmp_path)
    cluster.start()
    store = RedisTaskStore(cluster.url, names, ttl_s=120)
    old = AsyncRedis(port=cluster.primary_port)
    new = AsyncRedis(port=cluster.replica_port)
    try:
        await store.start()
        task_ids = [f"r{index}" for index in range(1000)]
        for task_id in task_ids:
            assert await store.create(state(task_id, TaskStatus.RUNNING))
        assert await old.wait(1, 5000) == 1, "the replica must hold every record before the failover"
        wait = ReplicaWait(store, ReplicaSettings(min_replicas=None, wait_ms=WAIT_MS), "w1", retry_max_s=0.05)
        committed: list[str] = []
        sentinel = AsyncRedis(port=cluster.sentinel_ports[0])
        try:
            assert await sentinel.execute_command("SENTINEL", "FAILOVER", MASTER)
        finally:
            await sentinel.aclose()
        started = time.monotonic()
        for task_id in task_ids:  # one result a worker commits after another, paced, until the old primary is demoted
            info = await old.info("replication")
            if info.get("role") == "slave" and info.get("master_link_status") == "up":
                break
            assert time.monotonic() - started < 60, "the Sentinels did not demote the old primary in 60 s"
            done = [state(task_id, TaskStatus.COMPLETED, output="ok")]
            if await wait.store_results(done, give_up=lambda: False, stopping=lambda: False):
                committed.append(task_id)
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the old primary was not demoted before the test ran out of results to commit")
        lost = [task_id for task_id in committed if await new.hget(names.task_key(task_id), "status") != b"completed"]
    finally:
        await store.close()
        await old.aclose()
        await new.aclose()
        cluster.stop()
    assert committed, "no result was committed across the failover"
    assert wait.short_stores, "no store came back short: the failover did not reach the results' writes"
    assert not lost, (
        f"{len(lost)} of {len(committed)} committed results were dropped by the demoted primary: {lost[:5]}"
    )
