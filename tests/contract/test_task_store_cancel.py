"""TaskStore contract, part two: cancellation, idempotency keys, and the owner that stays with a task."""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas.records import TaskState, TaskStatus
from tests.support.task_states import EVENT_TIMEOUT_S, next_state, state
from tests.support.transport_kits import StoreFactory

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("status", [TaskStatus.QUEUED, TaskStatus.BATCHED])
async def test_cancel_ends_a_task_no_worker_started(make_store: StoreFactory, status: TaskStatus) -> None:
    store = await make_store()
    await store.create(state("t1", TaskStatus.QUEUED, reply_to="g1", owner="o1"))
    if status is TaskStatus.BATCHED:
        assert await store.apply([state("t1", TaskStatus.BATCHED, reply_to="g1", batch_id="b1")]) == [True]

    cancelled = await store.cancel("t1", "cancelled", "by its owner")

    assert cancelled is not None
    assert cancelled.status is TaskStatus.CANCELLED, f"got {cancelled}"
    assert (cancelled.error_code, cancelled.error_message) == ("cancelled", "by its owner")
    assert cancelled.owner == "o1", "the owner must stay with the task"
    assert await store.get("t1") == cancelled


async def test_cancel_is_published_to_watchers_and_to_the_waiting_gateway(make_store: StoreFactory) -> None:
    gateway = await make_store()
    other = await make_store()  # DELETE may reach another gateway than the one holding the caller
    await gateway.create(state("t1", TaskStatus.QUEUED, reply_to="g1"))
    replies: list[TaskState] = []
    replied = asyncio.Event()

    def on_reply(reply: TaskState) -> None:
        replies.append(reply)
        replied.set()

    await gateway.listen_replies("g1", on_reply)
    async with gateway.watch("t1") as events:
        cancelled = await other.cancel("t1", "client_disconnected", "the caller left")
        assert cancelled is not None
        assert await next_state(events) == cancelled
        await asyncio.wait_for(replied.wait(), EVENT_TIMEOUT_S)
    assert [(r.task_id, r.status) for r in replies] == [("t1", TaskStatus.CANCELLED)]


@pytest.mark.parametrize("status", [TaskStatus.RUNNING, TaskStatus.COMPLETED, TaskStatus.FAILED])
async def test_cancel_is_refused_once_a_worker_started(make_store: StoreFactory, status: TaskStatus) -> None:
    store = await make_store()
    await store.create(state("t1", TaskStatus.QUEUED))
    started = state("t1", status, output="o" if status is TaskStatus.COMPLETED else None)
    assert await store.apply([started]) == [True]

    async with store.watch("t1") as events:
        answer = await store.cancel("t1", "cancelled", "too late")
        assert answer == started, "a refused cancel answers the state as it is"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(events), 0.1)  # a refused cancel publishes nothing
    assert await store.get("t1") == started


async def test_cancel_twice_answers_the_first_cancellation(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.create(state("t1", TaskStatus.QUEUED))
    first = await store.cancel("t1", "cancelled", "first")
    second = await store.cancel("t1", "cancelled", "second")
    assert first is not None
    assert second == first, f"expected the first cancellation, got {second}"


async def test_cancel_of_an_unknown_task_is_none(make_store: StoreFactory) -> None:
    store = await make_store()
    assert await store.cancel("nope", "cancelled", "x") is None
    assert await store.get("nope") is None, "cancel must not create a task"


async def test_a_cancelled_task_never_runs_nor_completes(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.create(state("t1", TaskStatus.QUEUED))
    await store.cancel("t1", "cancelled", "x")
    worker_updates = [
        state("t1", TaskStatus.BATCHED),
        state("t1", TaskStatus.RUNNING),
        state("t1", TaskStatus.COMPLETED, output="computed anyway"),
    ]
    assert await store.apply(worker_updates) == [False, False, False]
    stored = await store.get("t1")
    assert stored is not None
    assert stored.status is TaskStatus.CANCELLED, f"got {stored}"


async def test_cancel_races_running_and_exactly_one_wins(make_store: StoreFactory) -> None:
    """A worker's ``running`` and a cancel at the same instant, from two processes: one of them wins
    as a whole, never both (the worker drops an item whose ``running`` was refused)."""
    canceller = await make_store()
    worker = await make_store()
    outcomes: dict[str, int] = {"cancelled": 0, "running": 0}
    for index in range(40):
        task_id = f"race{index}"
        await canceller.create(state(task_id, TaskStatus.QUEUED))
        cancelled, applied = await asyncio.gather(
            canceller.cancel(task_id, "cancelled", "race"), worker.apply([state(task_id, TaskStatus.RUNNING)])
        )
        assert cancelled is not None
        stored = await canceller.get(task_id)
        assert stored is not None
        if applied == [True]:
            assert cancelled.status is TaskStatus.RUNNING, f"{task_id}: running applied, yet cancel said {cancelled}"
            assert stored.status is TaskStatus.RUNNING
            outcomes["running"] += 1
        else:
            assert cancelled.status is TaskStatus.CANCELLED, f"{task_id}: running refused, cancel said {cancelled}"
            assert stored.status is TaskStatus.CANCELLED
            outcomes["cancelled"] += 1
    assert sum(outcomes.values()) == 40, outcomes


async def test_the_owner_stays_with_the_task_through_every_update(make_store: StoreFactory) -> None:
    """Batchers and workers write states without knowing the owner; reads still have it."""
    store = await make_store()
    await store.create(state("t1", TaskStatus.QUEUED, owner="owner-a"))
    await store.apply([state("t1", TaskStatus.BATCHED)])
    await store.apply([state("t1", TaskStatus.RUNNING), state("t1", TaskStatus.COMPLETED, output="x")])

    stored = await store.get("t1")
    assert stored is not None
    assert (stored.status, stored.owner) == (TaskStatus.COMPLETED, "owner-a"), f"got {stored}"
    found = await store.get_many(["t1"])
    assert found["t1"].owner == "owner-a"


async def test_a_task_without_owner_has_none(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.create(state("t1", TaskStatus.QUEUED))
    await store.apply([state("t1", TaskStatus.COMPLETED, output="x")])
    stored = await store.get("t1")
    assert stored is not None
    assert stored.owner is None


# idempotency keys ---------------------------------------------------------------------------------


async def test_the_first_claim_of_a_key_wins(make_store: StoreFactory) -> None:
    first_gateway = await make_store()
    second_gateway = await make_store()

    won = await first_gateway.claim_key("owner", "key-1", "task-a", "fp-1")
    lost = await second_gateway.claim_key("owner", "key-1", "task-b", "fp-2")

    assert (won.task_id, won.fingerprint) == ("task-a", "fp-1")
    assert (lost.task_id, lost.fingerprint) == ("task-a", "fp-1"), "a later claim must see the first binding"


async def test_keys_are_scoped_by_owner(make_store: StoreFactory) -> None:
    store = await make_store()
    assert (await store.claim_key("owner-a", "same", "task-a", "fp")).task_id == "task-a"
    assert (await store.claim_key("owner-b", "same", "task-b", "fp")).task_id == "task-b"


async def test_concurrent_claims_all_see_one_winner(make_store: StoreFactory) -> None:
    stores = [await make_store() for _ in range(3)]
    claims = await asyncio.gather(
        *(stores[i % 3].claim_key("o", "contended", f"task-{i}", f"fp-{i}") for i in range(30))
    )
    winners = {(claim.task_id, claim.fingerprint) for claim in claims}
    assert len(winners) == 1, f"expected one winner, got {winners}"
    task_id, fingerprint = winners.pop()
    assert fingerprint == "fp-" + task_id.removeprefix("task-"), "the winner's own fingerprint must be kept"


async def test_release_frees_a_key_only_for_its_task(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.claim_key("o", "k", "task-a", "fp")
    await store.release_key("o", "k", "task-b")  # not the holder: no effect
    assert (await store.claim_key("o", "k", "task-c", "fp")).task_id == "task-a"

    await store.release_key("o", "k", "task-a")
    assert (await store.claim_key("o", "k", "task-d", "fp")).task_id == "task-d", "a released key is free"
    await store.release_key("o", "missing", "task-a")  # releasing an unknown key is harmless


async def test_keys_expire_with_the_results(make_store: StoreFactory) -> None:
    store = await make_store(ttl_s=0.3)
    await store.claim_key("o", "k", "task-a", "fp")
    deadline = time.monotonic() + 10
    while (await store.claim_key("o", "k", "task-b", "fp")).task_id != "task-b":
        assert time.monotonic() < deadline, "key still bound 10 s after a 0.3 s TTL"
        await asyncio.sleep(0.05)
