"""TaskStore contract: status only moves forward, terminal once, changes reach watchers and gateways."""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas.records import TaskState, TaskStatus
from tests.support.task_states import EVENT_TIMEOUT_S, next_state, state
from tests.support.transport_kits import StoreFactory

pytestmark = pytest.mark.timeout(60)


async def test_create_only_if_absent(make_store: StoreFactory) -> None:
    store = await make_store()
    first = state("t1", TaskStatus.QUEUED)

    assert await store.create(first) is True
    assert await store.create(state("t1", TaskStatus.QUEUED, enqueued_at_ms=2)) is False, "second create must fail"
    assert await store.get("t1") == first, "the first create's state must stay"
    assert await store.get("missing") is None


async def test_create_after_a_later_status_only_fills_in_the_owner(make_store: StoreFactory) -> None:
    """The gateway creates while it produces: a batcher's write may land first."""
    store = await make_store()
    batched = state("t1", TaskStatus.BATCHED, batch_id="b1")
    assert await store.apply([batched]) == [True]

    assert await store.create(state("t1", TaskStatus.QUEUED, owner="alice")) is True
    current = await store.get("t1")
    assert current is not None
    assert current.status is TaskStatus.BATCHED, f"the later status must stay, got {current}"
    assert current.owner == "alice", f"the owner must be filled in, got {current}"


async def test_creates_made_at_once_each_get_their_own_answer(make_store: StoreFactory) -> None:
    """A gateway's concurrent creates may travel together (one script call): each is judged alone."""
    store = await make_store()
    assert await store.apply([state("late", TaskStatus.BATCHED)]) == [True]
    creates = [state(f"t{i}", TaskStatus.QUEUED, owner=f"o{i}") for i in range(50)]
    creates += [state("t7", TaskStatus.QUEUED, enqueued_at_ms=2), state("late", TaskStatus.QUEUED, owner="ann")]

    created = await asyncio.gather(*(store.create(s) for s in creates))

    assert created == [True] * 50 + [False, True], "a duplicate in the same burst must still be refused"
    stored = await store.get_many([f"t{i}" for i in range(50)])
    assert all(stored[f"t{i}"] == creates[i] for i in range(50))
    late = await store.get("late")
    assert late is not None and late.status is TaskStatus.BATCHED and late.owner == "ann"


async def test_status_only_moves_forward(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.create(state("t1", TaskStatus.QUEUED))

    applied = await store.apply([state("t1", TaskStatus.BATCHED), state("t1", TaskStatus.RUNNING)])
    assert applied == [True, True]
    assert await store.apply([state("t1", TaskStatus.BATCHED)]) == [False], "rank 1 after rank 2 must be refused"
    assert await store.apply([state("t1", TaskStatus.RUNNING)]) == [False], "the same rank must be refused"
    assert await store.apply([]) == []

    current = await store.get("t1")
    assert current is not None
    assert current.status is TaskStatus.RUNNING, f"got {current}"


async def test_terminal_is_written_and_published_once(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.create(state("t1", TaskStatus.QUEUED, reply_to="g1"))
    replies: list[TaskState] = []
    marker_seen = asyncio.Event()

    def on_reply(reply: TaskState) -> None:
        replies.append(reply)
        if reply.task_id == "marker":
            marker_seen.set()

    await store.listen_replies("g1", on_reply)
    async with store.watch("t1") as events:
        done = state("t1", TaskStatus.COMPLETED, output="first", reply_to="g1")
        applied = await store.apply(
            [
                done,
                state("t1", TaskStatus.FAILED, error_code="E", reply_to="g1"),
                state("t1", TaskStatus.COMPLETED, output="second", reply_to="g1"),
            ]
        )
        assert applied == [True, False, False], "only the first terminal state may be written"
        assert await store.apply([state("t1", TaskStatus.EXPIRED, reply_to="g1")]) == [False]
        # Published after the refused ones on the same reply channel: once it arrives, anything the
        # refused updates had published would have arrived before it.
        await store.apply([state("marker", TaskStatus.COMPLETED, reply_to="g1")])
        await asyncio.wait_for(marker_seen.wait(), EVENT_TIMEOUT_S)

        assert [(r.task_id, r.output) for r in replies] == [("t1", "first"), ("marker", None)], f"got {replies}"
        assert await next_state(events) == done
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(events), 0.05)  # a refused update published nothing
    stored = await store.get("t1")
    assert stored is not None
    assert stored.output == "first", f"got {stored}"


async def test_an_unstored_synchronous_tasks_progress_is_checked_and_only_its_end_is_stored(
    make_store: StoreFactory,
) -> None:
    """No one else knows its id, and its caller waits for the end alone (``reply_to``): a step short
    of it says whether the task may still run, and stores nothing. A stored one's steps are stored."""
    store = await make_store()
    running = state("unstored", TaskStatus.RUNNING, reply_to="g1")
    assert await store.apply([running]) == [True], "a task no one stored may run"
    assert await store.get("unstored") is None, "and its progress is not stored"
    await store.create(state("keyed", TaskStatus.QUEUED, reply_to="g1"))
    assert await store.apply([state("keyed", TaskStatus.RUNNING, reply_to="g1")]) == [True]
    stored = await store.get("keyed")
    assert stored is not None and stored.status is TaskStatus.RUNNING, f"a stored task's progress is read: {stored}"
    await store.create(state("ended", TaskStatus.QUEUED, reply_to="g1"))
    assert await store.apply([state("ended", TaskStatus.CANCELLED, reply_to="g1")]) == [True]
    assert await store.apply([state("ended", TaskStatus.RUNNING, reply_to="g1")]) == [False], "an ended task may not"
    mixed = [state("other", TaskStatus.RUNNING, reply_to="g1"), state("ended", TaskStatus.RUNNING, reply_to="g1")]
    assert await store.apply(mixed) == [True, False], "each is checked on its own"
    done = state("unstored", TaskStatus.COMPLETED, output="ok", reply_to="g1")
    assert await store.apply([done]) == [True]
    assert await store.get("unstored") == done


async def test_watch_receives_changes_after_subscribing(make_store: StoreFactory) -> None:
    store = await make_store()
    async with store.watch("t1") as events:
        await store.create(state("t1", TaskStatus.QUEUED))
        await store.apply([state("t1", TaskStatus.BATCHED, batch_id="b1", batch_size=3)])
        await store.apply([state("t1", TaskStatus.RUNNING), state("t1", TaskStatus.COMPLETED, output="ok")])
        seen = [await next_state(events) for _ in range(4)]

    assert [s.status for s in seen] == [TaskStatus.QUEUED, TaskStatus.BATCHED, TaskStatus.RUNNING, TaskStatus.COMPLETED]
    assert (seen[1].batch_id, seen[1].batch_size) == ("b1", 3)
    assert seen[3].output == "ok"


async def test_watchers_of_one_task_are_counted(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.create(state("t1", TaskStatus.QUEUED))
    async with store.watch("t1") as staying:
        async with store.watch("t1") as leaving:
            await store.apply([state("t1", TaskStatus.BATCHED)])
            assert (await next_state(leaving)).status is TaskStatus.BATCHED
            assert (await next_state(staying)).status is TaskStatus.BATCHED
        # The other watcher left: this one must still be subscribed.
        await store.apply([state("t1", TaskStatus.RUNNING)])
        assert (await next_state(staying)).status is TaskStatus.RUNNING
    async with store.watch("t1") as again:
        await store.apply([state("t1", TaskStatus.COMPLETED)])
        assert (await next_state(again)).status is TaskStatus.COMPLETED


async def test_watch_does_not_see_other_tasks(make_store: StoreFactory) -> None:
    store = await make_store()
    async with store.watch("t1") as first, store.watch("t2") as second:
        await store.create(state("t2", TaskStatus.QUEUED))
        await store.create(state("t1", TaskStatus.QUEUED))
        assert (await next_state(first)).task_id == "t1"
        assert (await next_state(second)).task_id == "t2"


async def test_replies_reach_only_their_gateway_and_only_terminal(make_store: StoreFactory) -> None:
    gateway = await make_store()
    other_gateway = await make_store()
    writer = await make_store()  # a worker's store: replies cross processes (Redis) or not (memory)
    got: dict[str, list[TaskState]] = {"g1": [], "g2": []}
    arrived = {"g1": asyncio.Event(), "g2": asyncio.Event()}

    def handler(gateway_id: str) -> object:
        def on_reply(reply: TaskState) -> None:
            got[gateway_id].append(reply)
            arrived[gateway_id].set()

        return on_reply

    await gateway.listen_replies("g1", handler("g1"))  # type: ignore[arg-type]
    await other_gateway.listen_replies("g2", handler("g2"))  # type: ignore[arg-type]
    for task_id, reply_to in (("a", "g1"), ("b", "g2"), ("c", None)):
        await writer.create(state(task_id, TaskStatus.QUEUED, reply_to=reply_to))
    await writer.apply(
        [
            state("a", TaskStatus.RUNNING, reply_to="g1"),
            state("c", TaskStatus.COMPLETED),
            state("a", TaskStatus.COMPLETED, output="A", reply_to="g1"),
            state("b", TaskStatus.FAILED, error_code="OOM", reply_to="g2"),
        ]
    )
    await asyncio.wait_for(arrived["g1"].wait(), EVENT_TIMEOUT_S)
    await asyncio.wait_for(arrived["g2"].wait(), EVENT_TIMEOUT_S)

    assert [(r.task_id, r.status) for r in got["g1"]] == [("a", TaskStatus.COMPLETED)], f"g1 got {got['g1']}"
    assert [(r.task_id, r.status) for r in got["g2"]] == [("b", TaskStatus.FAILED)], f"g2 got {got['g2']}"


async def test_get_many(make_store: StoreFactory) -> None:
    store = await make_store()
    created = [state(f"t{i}", TaskStatus.QUEUED, enqueued_at_ms=i) for i in range(3)]
    for item in created:
        await store.create(item)

    found = await store.get_many(["t0", "t2", "missing", "t2"])
    assert found == {"t0": created[0], "t2": created[2]}
    assert await store.get_many([]) == {}


async def test_update_of_an_unknown_task_is_stored(make_store: StoreFactory) -> None:
    """A worker finishing a task whose queued entry expired still stores the result."""
    store = await make_store()
    done = state("gone", TaskStatus.COMPLETED, output="late")

    assert await store.apply([done]) == [True]
    assert await store.get("gone") == done


async def test_tasks_expire_after_ttl(make_store: StoreFactory) -> None:
    store = await make_store(ttl_s=0.3)
    await store.create(state("t1", TaskStatus.QUEUED))
    assert await store.get("t1") is not None

    deadline = time.monotonic() + 10
    while await store.get("t1") is not None:
        assert time.monotonic() < deadline, "task still stored 10 s after a 0.3 s TTL"
        await asyncio.sleep(0.05)


async def test_ready_until_closed(make_store: StoreFactory) -> None:
    store = await make_store()
    assert await store.ready() is True
    await store.close()
    assert await store.ready() is False
