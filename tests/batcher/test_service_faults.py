"""The batcher over in-memory transports that fail for a while: loops retry; permanent errors stop it loudly."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence

import pytest

from batcher.policy import FlushPolicy
from batcher.service import Batcher
from batcher.settings import BatcherSettings
from schemas.records import Credit, InferenceRequest, TaskState, TaskStatus
from telemetry.metrics import REGISTRY
from tests.support.eventually import eventually
from tests.support.metrics import tasks_ended
from transport.errors import PermanentTransportError
from transport.memory.batches import MemoryBatchBus
from transport.memory.credits import MemoryCreditPool
from transport.memory.requests import MemoryRequestBus, MemoryRequestConsumer
from transport.memory.store import MemoryTaskStore
from transport.ports import Delivered, TransportError
from transport.routing import Partitioner


class FlakyCredits(MemoryCreditPool):
    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def claim(self, model: str, timeout_s: float) -> Credit | None:
        if self.failures:
            self.failures -= 1
            raise TransportError("Redis connection refused")
        return await super().claim(model, timeout_s)


class FlakyRequests(MemoryRequestConsumer):
    def __init__(self, bus: MemoryRequestBus, failures: int, error: TransportError) -> None:
        super().__init__(bus)
        self.failures = failures
        self.error = error

    async def fetch(self, timeout_s: float, max_records: int) -> Sequence[Delivered[InferenceRequest]]:
        if self.failures:
            self.failures -= 1
            raise self.error
        return await super().fetch(timeout_s, max_records)


class FlakyStore(MemoryTaskStore):
    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def apply(self, updates: Sequence[TaskState], *, counted: bool = True) -> list[bool]:
        if self.failures:
            self.failures -= 1
            raise TransportError("Redis connection refused")
        return await super().apply(updates, counted=counted)


def now_ms() -> int:
    return int(time.time() * 1000)


class Rig:
    def __init__(
        self,
        credits: MemoryCreditPool | None = None,
        store: MemoryTaskStore | None = None,
        fetch_failures: int = 0,
        fetch_error: TransportError | None = None,
        settings: BatcherSettings | None = None,
    ) -> None:
        self.requests = MemoryRequestBus(Partitioner(("sim",), 2))
        self.batches = MemoryBatchBus(1)
        self.credits = credits or MemoryCreditPool()
        self.store = store or MemoryTaskStore()
        consumer = FlakyRequests(self.requests, fetch_failures, fetch_error or TransportError("broker down"))
        settings = settings or BatcherSettings(retry_max_s=0.05)
        self.batcher = Batcher(settings, consumer, self.batches, self.credits, self.store)

    async def request(self, task_id: str, deadline_ms: int = 30_000, reply_to: str | None = "gw") -> None:
        now = now_ms()
        request = InferenceRequest(task_id, "sim", task_id, now, now + deadline_ms, reply_to)
        await self.requests.producer().send(request)

    async def offer(self) -> None:
        now = now_ms()
        await self.credits.offer(Credit("w", "sim", 0, 1, now, now + 60_000))

    async def batch(self) -> list[str]:
        delivered = await self.batches.consumer(0).next(10)
        assert delivered is not None and delivered.value is not None, "a batch should have been sent"
        return [item.task_id for item in delivered.value.items]


async def test_claims_are_retried_while_the_credit_pool_is_unreachable() -> None:
    rig = Rig(credits=FlakyCredits(failures=3))
    await rig.batcher.start()
    await rig.request("r1")
    await rig.offer()
    assert await rig.batch() == ["r1"]
    assert rig.batcher.healthy()
    await rig.batcher.close()


async def test_reads_are_retried_while_the_broker_is_unreachable() -> None:
    rig = Rig(fetch_failures=4)
    await rig.batcher.start()
    await rig.request("r1")
    await rig.offer()
    assert await rig.batch() == ["r1"]
    assert rig.batcher.healthy()
    await rig.batcher.close()


async def test_a_permanent_read_error_stops_the_batcher_loudly() -> None:
    rig = Rig(fetch_failures=1, fetch_error=PermanentTransportError("topic deleted"))
    await rig.batcher.start()
    await asyncio.wait_for(rig.batcher.failed.wait(), 5)
    assert isinstance(rig.batcher.failure, PermanentTransportError)
    assert not rig.batcher.healthy()
    assert rig.batcher.state == "failed", "the fleet shows it failed, not idle, until its process exits"
    await rig.batcher.close()
    assert rig.batcher.state == "failed", "its last beat, at close, says failed: not a clean stop"


class BrokenBatchedWrites(MemoryTaskStore):
    """Fails ``batched`` writes with an error no transport raises: a bug, not an outage."""

    async def apply(self, updates: Sequence[TaskState], *, counted: bool = True) -> list[bool]:
        if any(state.status is TaskStatus.BATCHED for state in updates):
            raise TypeError("batch_size must be an int, not str")
        return await super().apply(updates, counted=counted)


async def test_an_unexpected_error_marking_a_batch_batched_stops_the_batcher_loudly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only a transport error there is informational (the worker's writes follow); any other is a bug,
    and ends the batcher as one in its other loops does, instead of being dropped."""
    rig = Rig(store=BrokenBatchedWrites())
    await rig.batcher.start()
    try:
        await rig.request("r1", reply_to=None)  # an asynchronous task: its "batched" state is written
        await rig.offer()
        assert await rig.batch() == ["r1"], "the batch itself lands"
        async with asyncio.timeout(5):
            await rig.batcher.failed.wait()
        assert isinstance(rig.batcher.failure, TypeError), f"the bug is the failure: {rig.batcher.failure!r}"
        assert not rig.batcher.healthy()
    finally:
        await rig.batcher.close()
    crashes = [r for r in caplog.records if r.levelno == logging.ERROR and "crashed" in r.getMessage()]
    assert [r.exc_info is not None and type(r.exc_info[1]) for r in crashes] == [TypeError], "logged with its traceback"


async def test_expiry_is_stored_once_the_store_is_back() -> None:
    store = FlakyStore(failures=3)
    rig = Rig(store=store)
    ended: list[TaskState] = []
    got = asyncio.Event()

    def on_reply(state: TaskState) -> None:
        ended.append(state)
        got.set()

    await store.listen_replies("gw", on_reply)
    await rig.batcher.start()
    await rig.request("late", deadline_ms=50)  # no worker offers a credit: it expires in the batcher
    await asyncio.wait_for(got.wait(), 10)
    await rig.batcher.close()
    assert [(s.task_id, s.status) for s in ended] == [("late", TaskStatus.EXPIRED)]
    assert store.failures == 0, "the failed writes were tried again"


async def test_an_expired_request_leaves_the_queue_at_once() -> None:
    """Its offset is committed when its expiry is stored, not at the next batch: the queue depth the
    gateway admits by (uncommitted requests) would otherwise show it waiting, and a quiet model
    would look stalled. Nor is it counted as held (``batchwire_batcher_pending``, the fleet's queue)."""
    rig = Rig()
    ended = asyncio.Event()
    await rig.store.listen_replies("gw", lambda state: ended.set())
    await rig.batcher.start()
    await rig.request("late", deadline_ms=50)  # no worker offers a credit: it expires in the batcher
    await asyncio.wait_for(ended.wait(), 10)
    await eventually(lambda: rig.requests.lag() == 0, "the expired request's offset to be committed")
    held = {"model": "sim"}
    await eventually(lambda: REGISTRY.get_sample_value("batchwire_batcher_pending", held) == 0, "the gauge to show it")
    await rig.batcher.close()


async def test_reading_goes_on_once_the_requests_that_filled_the_batcher_expired() -> None:
    """``max_held`` requests held stop the reads; their expiry, not only a send, makes room again.
    Claims that end empty before the deadlines leave the expiry to the batcher's timer."""
    policy = FlushPolicy.work_conserving(max_batch=2, reserve_ms=0)
    rig = Rig(settings=BatcherSettings(retry_max_s=0.05, policy=policy, max_held=2, claim_timeout_s=0.1))
    ended: set[str] = set()
    await rig.store.listen_replies("gw", lambda state: ended.add(state.task_id))
    await rig.batcher.start()
    await rig.request("late1", deadline_ms=300)  # no worker offers a credit: both expire in the batcher
    await rig.request("late2", deadline_ms=300)
    await eventually(lambda: ended == {"late1", "late2"}, "both held requests to expire")
    await rig.request("next")
    await rig.offer()
    assert await rig.batch() == ["next"]
    await rig.batcher.close()


async def test_an_expiry_of_a_task_a_delete_cancelled_first_is_not_counted() -> None:
    """The store refuses the batcher's ``expired`` (a terminal state is written once): the task's one
    end is the cancel, counted once, by the store that applied it."""
    rig = Rig()
    expired_before, cancelled_before = tasks_ended("expired"), tasks_ended("cancelled")
    await rig.store.create(TaskState("gone", TaskStatus.QUEUED, "sim", now_ms(), now_ms()))
    await rig.store.cancel("gone", "cancelled", "cancelled by its caller")
    await rig.batcher.start()
    await rig.request("gone", deadline_ms=50)  # no worker offers a credit: it expires in the batcher
    await eventually(lambda: rig.requests.lag() == 0, "the expired request's offset to be committed")
    await rig.batcher.close()
    stored = await rig.store.get("gone")
    assert stored is not None and stored.status is TaskStatus.CANCELLED, f"the cancel stands: {stored}"
    assert tasks_ended("expired") - expired_before == 0, "the refused expiry is not counted"
    assert tasks_ended("cancelled") - cancelled_before == 1, "the cancel is the task's one end"


async def test_a_request_read_again_after_its_expiry_is_counted_once() -> None:
    """A batcher that dies after storing an expiry but before committing its offset leaves the request
    to the batcher that reads it again; that batcher's expiry changes nothing and is not counted."""
    rig = Rig()
    before = tasks_ended("expired")
    await rig.batcher.start()
    await rig.request("late", deadline_ms=50)
    await rig.request("late", deadline_ms=50)  # the same request read again
    await eventually(lambda: rig.requests.lag() == 0, "both reads' offsets to be committed")
    await rig.batcher.close()
    assert tasks_ended("expired") - before == 1, f"one end, counted once; counted {tasks_ended('expired') - before}"


class FailingCommits(MemoryRequestConsumer):
    """Refuses the first ``failures`` commits (the group's coordinator moving to another broker)."""

    def __init__(self, bus: MemoryRequestBus, failures: int) -> None:
        super().__init__(bus)
        self.failures = failures

    async def commit(self, offsets: Mapping[int, int]) -> None:
        if self.failures:
            self.failures -= 1
            raise TransportError("the group coordinator is not available")
        await super().commit(offsets)


async def handed_over_r1(failures: int, retry_max_s: float) -> tuple[Rig, FailingCommits]:
    """A batcher whose first ``failures`` commits are refused, started, with request r1 handed to a worker."""
    rig = Rig()
    consumer = FailingCommits(rig.requests, failures=failures)
    rig.batcher = Batcher(BatcherSettings(retry_max_s=retry_max_s), consumer, rig.batches, rig.credits, rig.store)
    await rig.batcher.start()
    try:
        await rig.request("r1")
        await rig.offer()
        assert await rig.batch() == ["r1"]
    except BaseException:
        await rig.batcher.close()
        raise
    return rig, consumer


async def test_a_failed_commit_is_tried_again_while_nothing_else_comes() -> None:
    """The last hand-over's commit fails and no request follows: the commit is tried again, so the
    queue depth the gateways admit by (uncommitted requests) does not show a request that left."""
    rig, consumer = await handed_over_r1(failures=1, retry_max_s=0.05)
    try:
        await eventually(lambda: consumer.failures == 0, "the hand-over's commit to be tried (and refused)")
        await eventually(lambda: rig.requests.lag() == 0, "r1's offset committed on a later try", timeout_s=5)
    finally:
        await rig.batcher.close()


async def test_a_close_does_not_wait_out_a_failed_commits_pause() -> None:
    """The close commits once more itself: a retry pausing meanwhile (up to ``retry_max_s``) is stopped, not
    waited for."""
    rig, consumer = await handed_over_r1(failures=1_000_000, retry_max_s=30.0)
    try:
        refused = consumer.failures
        # pauses of 0.1, 0.2, 0.4, 0.8 and 1.6 s: after the sixth refusal the retry pauses 3.2 s
        await eventually(lambda: consumer.failures <= refused - 6, "six commits refused", timeout_s=15)
    finally:
        started = time.monotonic()
        await rig.batcher.close()
    assert time.monotonic() - started < 2.0, "the close waited out the retry's pause"


class HangingExpiries(MemoryTaskStore):
    """A store whose writes of expired states wait until ``release`` (a Redis replica that lags, a
    store that is slow); ``hanging`` is set once one waits."""

    def __init__(self) -> None:
        super().__init__()
        self.hanging = asyncio.Event()
        self.release = asyncio.Event()

    async def apply(self, updates: Sequence[TaskState], *, counted: bool = True) -> list[bool]:
        if any(update.status is TaskStatus.EXPIRED for update in updates):
            self.hanging.set()
            await self.release.wait()
        return await super().apply(updates, counted=counted)


@pytest.mark.parametrize(
    "policy",
    [FlushPolicy.classic(max_batch=8, max_wait_ms=50), FlushPolicy.work_conserving(max_batch=8, reserve_ms=0)],
    ids=["classic", "work-conserving"],
)
async def test_a_slow_expiry_write_holds_up_no_batch(policy: FlushPolicy) -> None:
    """The end of an expired request is stored beside the timer that seals batches by age and the
    dispatch that sends them: an idle worker gets the live requests while that write waits."""
    store = HangingExpiries()
    rig = Rig(store=store, settings=BatcherSettings(retry_max_s=0.05, policy=policy))
    await rig.batcher.start()
    try:
        await rig.request("late", deadline_ms=-1000)  # expired on arrival: its write hangs
        async with asyncio.timeout(10):
            await store.hanging.wait()
        await rig.request("gone", deadline_ms=-1000)  # expired too; the batch below meets it first
        await rig.request("live")
        await eventually(lambda: rig.batcher.former.held("sim") >= 1, "the live request to be held")
        await rig.offer()
        assert await rig.batch() == ["live"], "the live request goes to the idle worker"
        await rig.request("next")
        now = now_ms()
        await rig.credits.offer(Credit("w", "sim", 0, 2, now, now + 60_000))
        assert await rig.batch() == ["next"], "the next request goes to the idle worker while the write waits"
    finally:
        store.release.set()
        await rig.batcher.close()
