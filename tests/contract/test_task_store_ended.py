"""TaskStore contract: ``batchwire_tasks_ended`` counts each end once, in the process whose write applied it.

A batcher's expiry of a task a caller cancelled, an end written again after a redelivery, or a
gateway's expiry racing a batcher's: the store refuses every write after the first end, and only
the write it applied is counted, whichever call wrote it (``apply``, ``apply_replicated``, ``cancel``).
"""

from __future__ import annotations

import uuid

import pytest
from redis.crc import key_slot

from schemas.records import TaskStatus
from schemas.wire import Names
from tests.conftest import KEYED_CLUSTER, KEYED_SENTINEL
from tests.support.metrics import ends_by_status
from tests.support.task_states import state
from tests.support.transport_kits import REAL, StoreFactory
from transport.ports import TransportError
from transport.redis.pools import PoolOptions, cluster_client
from transport.redis.store import RedisTaskStore

pytestmark = pytest.mark.timeout(60)

on_redis = pytest.mark.parametrize(
    "keyed_kind", [pytest.param(kind, marks=pytest.mark.kafka) for kind in (REAL, KEYED_CLUSTER, KEYED_SENTINEL)]
)
"""A test of what only the Redis store does (waits for replicas): each Redis deployment, no memory case."""


async def test_an_end_is_counted_by_the_write_that_applied_it_and_by_no_other(make_store: StoreFactory) -> None:
    model = f"m{uuid.uuid4().hex[:8]}"  # counts of this test alone: the registry is the process's
    store = await make_store()
    other = await make_store()  # another process's view: a batcher beside the worker, say
    for task_id in ("t1", "t2", "t3"):
        await store.create(state(task_id, TaskStatus.QUEUED, model=model))

    assert await store.apply([state("t1", TaskStatus.COMPLETED, model=model, output="x")]) == [True]
    assert await other.apply([state("t1", TaskStatus.EXPIRED, model=model)]) == [False], "t1 ended already"
    assert await store.apply([state("t1", TaskStatus.COMPLETED, model=model, output="x")]) == [False]
    assert ends_by_status(model) == {"completed": 1.0}, f"one end, counted once: {ends_by_status(model)}"

    assert await store.cancel("t2", "cancelled", "by its caller") is not None
    assert await other.cancel("t2", "cancelled", "by its caller again") is not None  # cancelled already
    assert await other.apply([state("t2", TaskStatus.EXPIRED, model=model)]) == [False], "t2 ended already"
    assert ends_by_status(model) == {"completed": 1.0, "cancelled": 1.0}, (
        f"the cancel, counted once: {ends_by_status(model)}"
    )

    expired = await other.cancel("t3", "deadline_exceeded", "past its deadline", TaskStatus.EXPIRED)
    assert expired is not None and expired.status is TaskStatus.EXPIRED, expired
    assert await store.apply([state("t3", TaskStatus.EXPIRED, model=model)]) == [False], "t3 ended already"
    assert await store.cancel("t3", "cancelled", "too late") == expired, "an ended task is not cancelled"
    want = {"completed": 1.0, "cancelled": 1.0, "expired": 1.0}
    assert ends_by_status(model) == want, f"the gateway's expiry, counted once: {ends_by_status(model)}"

    # A synchronous task no one stored: its end is its first write.
    assert await store.apply([state("s1", TaskStatus.COMPLETED, model=model, reply_to="g1", output="y")]) == [True]
    assert await other.apply([state("s1", TaskStatus.COMPLETED, model=model, reply_to="g1", output="y")]) == [False]
    want["completed"] = 2.0
    assert ends_by_status(model) == want, f"the synchronous task's end, counted once: {ends_by_status(model)}"

    # A copy of an end counted elsewhere (a collapsed computation's, onto a caller's task).
    assert await store.apply([state("s2", TaskStatus.COMPLETED, model=model, output="y")], counted=False) == [True]
    assert ends_by_status(model) == want, f"the copy is not counted: {ends_by_status(model)}"


@on_redis
async def test_an_end_stored_while_waiting_for_replicas_is_counted_once(make_store: StoreFactory) -> None:
    """A short store is tried again (``ReplicaWait``), and a worker stores a batch's ends again with its
    results: only the write that applied an end counts it."""
    store = await make_store()
    assert isinstance(store, RedisTaskStore)
    model = f"m{uuid.uuid4().hex[:8]}"
    ends = [state(f"t{i}", TaskStatus.EXPIRED, model=model) for i in range(4)]  # several hash slots in a cluster
    await store.create(state("t0", TaskStatus.QUEUED, model=model))
    await store.apply_replicated(ends, 0, 100)
    await store.apply_replicated(ends, 0, 100)  # stored again: no-ops
    assert await store.apply(ends) == [False] * 4
    assert ends_by_status(model) == {"expired": 4.0}, f"each end counted once: {ends_by_status(model)}"


@on_redis
async def test_an_end_stored_before_the_replica_wait_failed_is_counted(make_store: StoreFactory) -> None:
    """``apply_replicated`` stores the ends, then waits for replicas, in one pipeline: a wait that fails
    (here a timeout Redis refuses) fails the call after the ends were stored, and they are counted all
    the same, as a retry of it finds them ended and counts nothing."""
    store = await make_store()
    assert isinstance(store, RedisTaskStore)
    model = f"m{uuid.uuid4().hex[:8]}"
    ends = [state(f"t{i}", TaskStatus.COMPLETED, model=model, output="x") for i in range(2)]
    with pytest.raises(TransportError):
        await store.apply_replicated(ends, 0, -1)
    assert await store.apply(ends) == [False, False], "the ends were stored before the wait failed"
    assert ends_by_status(model) == {"completed": 2.0}, f"each stored end, counted once: {ends_by_status(model)}"


@pytest.mark.kafka
@pytest.mark.parametrize("replicated", [False, True], ids=["apply", "apply_replicated"])
async def test_an_end_a_cluster_write_stored_is_counted_though_another_slot_failed(
    redis_cluster: str, names: Names, replicated: bool
) -> None:
    """A write over a cluster runs one script call per hash slot: the ends one call stored are counted
    though another slot's call fails the write, as a retry of it finds them ended and counts nothing."""
    model = f"m{uuid.uuid4().hex[:8]}"
    good = "good-0"
    bad = next(f"bad-{n}" for n in range(100) if key_slot(f"bad-{n}".encode()) != key_slot(good.encode()))
    raw = cluster_client(redis_cluster, PoolOptions())
    store = RedisTaskStore(redis_cluster, names)
    await store.start()
    try:
        await raw.set(names.task_key(bad), "not a task")
        ends = [state(task_id, TaskStatus.COMPLETED, model=model, output="x") for task_id in (good, bad)]
        with pytest.raises(TransportError):
            await (store.apply_replicated(ends, 0, 100) if replicated else store.apply(ends))
        assert await store.apply(ends[:1]) == [False], "the good slot's call stored its end"
        assert ends_by_status(model) == {"completed": 1.0}, f"the stored end, counted once: {ends_by_status(model)}"
    finally:
        await store.close()
        await raw.aclose()
