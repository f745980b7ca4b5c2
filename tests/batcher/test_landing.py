"""A sealed batch lands on the bus in a task of its own: the next worker's batch does not wait for
the first one's acknowledgement, and a request is handed over (committed) only once its batch landed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from batcher.policy import FlushPolicy
from batcher.service import Batcher
from batcher.settings import BatcherSettings
from schemas.records import Batch, Credit, InferenceRequest, TaskState
from tests.support.eventually import eventually
from transport.memory.batches import MemoryBatchBus
from transport.memory.credits import MemoryCreditPool
from transport.memory.requests import MemoryRequestBus
from transport.memory.store import MemoryTaskStore
from transport.ports import TransportError
from transport.routing import Partitioner


class GatedBatchBus(MemoryBatchBus):
    """Holds the sends of batches bound for the ``held`` partitions until ``release`` is set (a broker
    slow to acknowledge); ``failures`` sends raise first, as a broker that refuses them."""

    def __init__(self, partitions: int, held: Iterable[int] = (), failures: int = 0) -> None:
        super().__init__(partitions)
        self.held = frozenset(held)
        self.failures = failures
        self.release = asyncio.Event()
        self.holding = asyncio.Event()
        self.sent: list[tuple[int, list[str]]] = []

    async def send(self, batch: Batch, partition: int) -> None:
        if self.failures:
            self.failures -= 1
            raise TransportError("the broker refused the batch")
        if partition in self.held:
            self.holding.set()
            await self.release.wait()
        self.sent.append((partition, [item.task_id for item in batch.items]))
        await super().send(batch, partition)


def now_ms() -> int:
    return int(time.time() * 1000)


def credit(worker: str, partition: int, idle_ms: int = 0) -> Credit:
    now = now_ms() - idle_ms
    return Credit(worker, "sim", partition, 1, now, now + 60_000)


class Rig:
    def __init__(
        self, batches: GatedBatchBus, credits: MemoryCreditPool | None = None, send_retry_s: float = 0.01
    ) -> None:
        self.requests = MemoryRequestBus(Partitioner(("sim",), 1))
        self.batches = batches
        self.credits = credits or MemoryCreditPool()
        settings = BatcherSettings(models=("sim",), request_partitions=1, send_retry_s=send_retry_s)
        self.batcher = Batcher(settings, self.requests.consumer(), batches, self.credits, MemoryTaskStore())

    async def request(self, task_id: str) -> None:
        now = now_ms()
        await self.requests.producer().send(InferenceRequest(task_id, "sim", task_id, now, now + 30_000, "gw"))

    async def batch_for(self, task_id: str, worker: str, partition: int) -> None:
        """A request, and an idle worker's credit to send it against."""
        await self.request(task_id)
        await self.credits.offer(credit(worker, partition))


async def test_the_next_workers_batch_goes_out_while_the_first_is_still_landing() -> None:
    rig = Rig(GatedBatchBus(2, held=[0]))
    await rig.batcher.start()
    try:
        await rig.batch_for("r1", "w1", 0)
        await asyncio.wait_for(rig.batches.holding.wait(), 5)  # w1's batch waits for its acknowledgement
        await rig.batch_for("r2", "w2", 1)
        await eventually(lambda: rig.batches.sent == [(1, ["r2"])], "w2's batch, while w1's still lands", timeout_s=5)
        assert rig.requests.lag() == 2, "r1's batch has not landed: the commit point stays below r1 (and r2)"
        rig.batches.release.set()
        await eventually(lambda: rig.requests.lag() == 0, "r1 committed once its batch landed", timeout_s=5)
        assert rig.batches.sent == [(1, ["r2"]), (0, ["r1"])]
    finally:
        rig.batches.release.set()
        await rig.batcher.close()


async def test_a_close_waits_for_a_landing_batch_and_commits_it() -> None:
    rig = Rig(GatedBatchBus(1, held=[0]))
    await rig.batcher.start()
    await rig.batch_for("r1", "w1", 0)
    await asyncio.wait_for(rig.batches.holding.wait(), 5)
    closing = asyncio.create_task(rig.batcher.close())
    done, _ = await asyncio.wait({closing}, timeout=0.3)  # a close that did not wait would be done by now
    assert not done, "the close waits for the batch on its way"
    rig.batches.release.set()
    await asyncio.wait_for(closing, 5)
    assert rig.batches.sent == [(0, ["r1"])]
    assert rig.requests.lag() == 0, "the landed batch's request was committed before the batcher left"


async def test_a_batch_the_bus_refused_goes_out_again_with_its_requests() -> None:
    rig = Rig(GatedBatchBus(1, failures=1))
    await rig.batcher.start()
    try:
        await rig.batch_for("r1", "w1", 0)
        await eventually(lambda: rig.batches.sent == [(0, ["r1"])], "r1 sent again, against its credit offered back")
        await eventually(lambda: rig.requests.lag() == 0, "r1 committed once its batch landed")
        assert rig.batcher.healthy()
    finally:
        await rig.batcher.close()


class OnePartitionDown(GatedBatchBus):
    """Refuses every send to the ``down`` partitions (its leader is being elected, or unreachable)."""

    def __init__(self, partitions: int, down: Iterable[int]) -> None:
        super().__init__(partitions)
        self.down = set(down)
        self.refused = 0

    async def send(self, batch: Batch, partition: int) -> None:
        if partition in self.down:
            self.refused += 1
            raise TransportError(f"partition {partition} has no leader")
        await super().send(batch, partition)


async def test_a_partition_that_refuses_sends_does_not_keep_requests_from_another_idle_worker() -> None:
    """w0 is idle longest, so its credit is claimed first, but its partition refuses the batch: r1 goes
    to w1 after the pause, not to w0 again and again until w0 refreshes its credit. w0's credit is
    not lost: it takes the next batch once its partition takes sends."""
    bus = OnePartitionDown(2, down=[0])
    rig = Rig(bus, send_retry_s=0.2)
    await rig.credits.offer(credit("w0", 0, idle_ms=1_000))
    await rig.credits.offer(credit("w1", 1))
    await rig.batcher.start()
    try:
        await rig.request("r1")
        await eventually(lambda: bus.refused, "a send to w0's partition refused", timeout_s=5)
        await eventually(
            lambda: rig.batches.sent == [(1, ["r1"])],
            "r1 sent to w1 on partition 1 while w0's partition refuses sends, well before w0 would refresh "
            "its credit (about 4 s)",
            timeout_s=2,
        )
        bus.down.clear()
        await rig.request("r2")
        await eventually(
            lambda: rig.batches.sent == [(1, ["r1"]), (0, ["r2"])],
            "r2 sent to w0 against its credit given back, once its partition takes sends",
            timeout_s=5,
        )
        await eventually(lambda: rig.requests.lag() == 0, "r1 and r2 committed once their batches landed")
    finally:
        await rig.batcher.close()


class RefusedLateBus(MemoryBatchBus):
    """Holds each send until ``release`` is set, then refuses it (a broker that never acknowledged)."""

    def __init__(self) -> None:
        super().__init__(1)
        self.release = asyncio.Event()
        self.holding = asyncio.Event()

    async def send(self, batch: Batch, partition: int) -> None:
        self.holding.set()
        await self.release.wait()
        raise TransportError("no ack within the request timeout")


class GoneWorkerCredits(MemoryCreditPool):
    """Takes no credit once ``gone`` is set: the worker died, and the credit given back expired."""

    def __init__(self) -> None:
        super().__init__()
        self.gone = False

    async def offer(self, credit: Credit, *, after_ms: int = 0) -> None:
        if not self.gone:
            await super().offer(credit, after_ms=after_ms)


async def test_a_batch_given_back_by_a_refused_send_still_expires_at_its_deadline() -> None:
    """The timer last looked while r1 was on its way (r2 came then, due in a minute): r1, put back by
    the refused send with no worker left to take it, still ends at its own deadline."""
    credits = GoneWorkerCredits()
    bus = RefusedLateBus()
    store = MemoryTaskStore()
    ended: dict[str, str] = {}
    r1_ended = asyncio.Event()

    def on_reply(state: TaskState) -> None:
        ended[state.task_id] = state.status.value
        if state.task_id == "r1":
            r1_ended.set()

    await store.listen_replies("gw", on_reply)
    requests = MemoryRequestBus(Partitioner(("sim",), 1))
    policy = FlushPolicy.work_conserving(max_wait_ms=60_000)  # no seal timer ends r2's wait soon
    settings = BatcherSettings(policy=policy, models=("sim",), request_partitions=1, claim_timeout_s=0.05)
    batcher = Batcher(settings, requests.consumer(), bus, credits, store)
    await batcher.start()
    try:
        now = now_ms()
        await requests.producer().send(InferenceRequest("r1", "sim", "r1", now, now + 500, "gw"))
        await credits.offer(credit("w1", 0))
        await asyncio.wait_for(bus.holding.wait(), 5)  # r1's batch is on its way
        await requests.producer().send(InferenceRequest("r2", "sim", "r2", now, now + 60_000, "gw"))
        await eventually(lambda: batcher.former.held("sim") == 1, "r2 held while r1's batch lands")
        credits.gone = True  # r1's worker dies: the credit its refused send gives back goes nowhere
        bus.release.set()
        await eventually(lambda: batcher.former.held("sim") == 2, "r1 put back by the refused send")
        try:
            await asyncio.wait_for(r1_ended.wait(), 5)
        except TimeoutError:
            raise AssertionError(f"r1 (deadline 0.5 s) ends expired within 5 s; ended so far: {ended}") from None
        assert ended == {"r1": "expired"}, ended
        await eventually(lambda: requests.lag() == 1, "r1 committed once it expired (r2 still held)", timeout_s=5)
    finally:
        bus.release.set()
        await batcher.close()
