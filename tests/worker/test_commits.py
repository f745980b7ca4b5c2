"""Committer: batches are stored and committed in the order they are handed in, and none is
committed after one that was left uncommitted."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from gpu_worker.commits import Committer
from schemas.records import Batch, TaskState, TaskStatus
from tests.support.eventually import eventually
from tests.support.worker_rig import now_ms
from transport.deliveries import MemoryDeliveryLog
from transport.memory.store import MemoryTaskStore
from transport.ports import Delivered, TransportError

T = TypeVar("T")


class Recording:
    """A batch consumer that records commits (nothing else is used)."""

    def __init__(self) -> None:
        self.committed: list[int] = []

    async def commit(self, delivered: Delivered[Batch]) -> None:
        self.committed.append(delivered.offset)


class GatedStore(MemoryTaskStore):
    """Holds the writes of ``slow`` until ``gate`` opens; refuses those of ``broken``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.stored: list[str] = []

    async def apply(self, updates: Sequence[TaskState]) -> list[bool]:
        if any(state.task_id == "slow" for state in updates):
            await self.gate.wait()
        if any(state.task_id == "broken" for state in updates):
            raise TransportError("the store refused it")
        self.stored.extend(state.task_id for state in updates)
        return await super().apply(updates)


async def once(what: str, op: Callable[[], Awaitable[T]]) -> T:
    return await op()


def handed(offset: int, task_id: str) -> tuple[Delivered[Batch], list[TaskState]]:
    batch = Batch(f"b{offset}", "sim", "test", now_ms(), "idle_worker")
    state = TaskState(task_id, TaskStatus.COMPLETED, "sim", now_ms(), 0, output="x")
    return Delivered(batch, 0, offset), [state]


def hand_in(commits: Committer, offset: int, task_id: str) -> asyncio.Future[None]:
    """A batch fetched with its results ready at once."""
    delivered, states = handed(offset, task_id)
    return commits.fill(commits.reserve(delivered), states)


def committer(store: GatedStore, consumer: Recording, failures: list[BaseException]) -> Committer:
    return Committer(
        "w1",
        consumer,  # type: ignore[arg-type]
        store,
        MemoryDeliveryLog(),
        None,
        once,
        failures.append,
        abandoned=lambda: False,
        stopping=lambda: False,
    )


async def test_a_batch_ready_first_waits_for_the_one_handed_in_before_it() -> None:
    store, consumer, failures = GatedStore(), Recording(), []
    commits = committer(store, consumer, failures)
    commits.start()
    first = hand_in(commits, 1, "slow")
    second = hand_in(commits, 2, "quick")
    await asyncio.sleep(0.05)
    assert store.stored == [] and consumer.committed == [], "the second batch must wait for the first"
    store.gate.set()
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    await commits.close()
    assert store.stored == ["slow", "quick"] and consumer.committed == [1, 2]
    assert commits.batches_done == 2 and failures == []


async def test_no_batch_is_committed_after_one_whose_results_could_not_be_stored() -> None:
    store, consumer, failures = GatedStore(), Recording(), []
    store.gate.set()
    commits = committer(store, consumer, failures)
    commits.start()
    hand_in(commits, 1, "fine")
    hand_in(commits, 2, "broken")
    hand_in(commits, 3, "after")
    await asyncio.wait_for(commits.drained(), 5)
    await commits.close()
    assert [type(err) for err in failures] == [TransportError], f"the failure is reported once, got {failures}"
    assert store.stored == ["fine", "after"], "a later batch's results are still stored"
    assert consumer.committed == [1], f"committing 3 would commit 2, which is not stored; got {consumer.committed}"


class GatedCommits(Recording):
    """Holds the commit of offset 1 until ``gate`` opens (a coordinator failing over)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def commit(self, delivered: Delivered[Batch]) -> None:
        if delivered.offset == 1:
            await self.gate.wait()
        await super().commit(delivered)


async def test_a_batchs_results_are_stored_while_an_earlier_commit_waits() -> None:
    """Callers must not wait for a commit: it may wait for a Kafka record a broker's failover holds up."""
    store, consumer, failures = GatedStore(), GatedCommits(), []
    store.gate.set()
    commits = committer(store, consumer, failures)
    commits.start()
    first = hand_in(commits, 1, "first")
    second = hand_in(commits, 2, "second")
    await eventually(lambda: store.stored == ["first", "second"], "both batches' results stored")
    assert consumer.committed == [] and not first.done() and not second.done(), "the commits still wait in order"
    consumer.gate.set()
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    await commits.close()
    assert consumer.committed == [1, 2] and failures == []


async def test_a_batch_fetched_first_is_committed_first_whichever_call_ends_first() -> None:
    """A failing call is split and runs again behind the call queued after it: the later batch's
    results are stored at once, and its commit (which commits every offset before it) waits."""
    store, consumer, failures = GatedStore(), Recording(), []
    store.gate.set()
    commits = committer(store, consumer, failures)
    commits.start()
    earlier = commits.reserve(handed(1, "split")[0])
    later = hand_in(commits, 2, "quick")
    await eventually(lambda: store.stored == ["quick"], "the later batch's results are stored at once")
    assert consumer.committed == [], "committing offset 2 would commit offset 1, whose results are not stored"
    commits.fill(earlier, handed(1, "split")[1])
    await asyncio.wait_for(later, 5)
    await commits.close()
    assert consumer.committed == [1, 2] and failures == []


async def test_a_batch_given_up_goes_back_uncommitted_with_every_batch_after_it() -> None:
    store, consumer, failures = GatedStore(), Recording(), []
    store.gate.set()
    commits = committer(store, consumer, failures)
    commits.start()
    hand_in(commits, 1, "fine")
    hung = commits.reserve(handed(2, "hung")[0])
    hand_in(commits, 3, "after")
    commits.give_up(hung)
    commits.give_up(hung)  # a call's task ends after its slot was given up: nothing more
    await asyncio.wait_for(commits.drained(), 5)
    await commits.close()
    assert consumer.committed == [1], f"committing 3 would commit 2, which has no results; got {consumer.committed}"
    assert [batch.batch_id for batch in commits.given_back] == ["b2", "b3"], "a supervisor sends both again"


class Refusing(Recording):
    """A batch consumer whose commits the group refuses (its partition moved to another worker)."""

    async def commit(self, delivered: Delivered[Batch]) -> None:
        raise TransportError("commit refused: the group rebalanced")


async def test_a_batch_whose_commit_failed_keeps_its_delivery_record() -> None:
    """It comes again, perhaps to a worker that holds it already: its deliveries, marks and strikes
    still count. Forgotten, its next delivery would read as a first, and a crashing input's strikes
    would start over."""
    store, failures, deliveries = GatedStore(), [], MemoryDeliveryLog()
    commits = Committer(
        "w1",
        Refusing(),  # type: ignore[arg-type]
        store,
        deliveries,
        None,
        once,
        failures.append,
        abandoned=lambda: False,
        stopping=lambda: False,
    )
    commits.start()
    delivered, states = handed(0, "t0")
    assert delivered.value is not None
    await deliveries.begin(delivered.value.batch_id, "w1's")
    await deliveries.begin(delivered.value.batch_id, "w2's, running it meanwhile")
    await asyncio.wait_for(commits.fill(commits.reserve(delivered), states), 5)
    await commits.close()
    assert await deliveries.begin(delivered.value.batch_id, "w3's") == 3, "the batch's third delivery"
    assert not failures
