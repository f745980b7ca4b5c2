"""A worker offers a credit only when no batch waits for it: a batch already on its way (sent against
an earlier credit, as when its group forms under load) is taken first, so the worker never runs one
batch behind, each batch waiting a call longer than it needs."""

from __future__ import annotations

import asyncio
from collections.abc import Sized
from dataclasses import replace

from schemas.records import Batch, Credit
from tests.support.eventually import eventually
from tests.support.worker_rig import RecordingConsumer, Rig, ScriptedBackend
from transport.memory.credits import MemoryCreditPool
from transport.ports import Delivered, PartitionsCallback


class WatchedCredits(MemoryCreditPool):
    """Records, at each offer, how many batches wait on the worker's partition."""

    def __init__(self) -> None:
        super().__init__()
        self.partition: Sized = ()
        self.waiting_at_offer: list[int] = []

    async def offer(self, credit: Credit, *, after_ms: int = 0) -> None:
        self.waiting_at_offer.append(len(self.partition))
        await super().offer(credit, after_ms=after_ms)


async def test_a_batch_already_waiting_is_taken_before_a_new_credit_is_offered() -> None:
    credits = WatchedCredits()
    rig = Rig(credits=credits)
    credits.partition = rig.bus.queues[0]
    await rig.listen()
    first, second = rig.batch(["one"], "b1"), rig.batch(["two"], "b2")
    second = replace(second, items=tuple(replace(item, task_id="u0") for item in second.items))
    for batch in (first, second):
        await rig.create(batch)
        await rig.send(batch)  # both before the worker starts: two batches on their way to one worker
    backend = ScriptedBackend(latency_s=0.1)
    worker = await rig.worker(backend)
    ended = await rig.ended(["t0", "u0"])
    await worker.close()
    assert [ended["t0"].output, ended["u0"].output] == ["eno", "owt"]
    assert backend.calls == [["one"], ["two"]]
    assert credits.waiting_at_offer, "a credit is offered once nothing waits"
    assert all(waiting == 0 for waiting in credits.waiting_at_offer), (
        f"a credit was offered while a batch waited: {credits.waiting_at_offer}"
    )


class RevokingConsumer(RecordingConsumer):
    """Keeps the worker's revocation callback, and counts the fetches made while a revocation runs."""

    revoking = False
    fetches_while_revoking = 0

    async def start(self, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback) -> None:
        self.on_revoked = on_revoked
        await super().start(on_assigned, on_revoked)

    async def revoke(self, partitions: frozenset[int]) -> None:
        self.revoking = True
        try:
            await self.on_revoked(partitions)
        finally:
            self.revoking = False

    async def next(self, timeout_s: float) -> Delivered[Batch] | None:
        self.fetches_while_revoking += self.revoking
        return await super().next(timeout_s)


class OffersWhileRevoking(MemoryCreditPool):
    def __init__(self) -> None:
        super().__init__()
        self.consumer: RevokingConsumer | None = None
        self.offered_while_revoking: list[Credit] = []

    async def offer(self, credit: Credit, *, after_ms: int = 0) -> None:
        if self.consumer is not None and self.consumer.revoking:
            self.offered_while_revoking.append(credit)
        await super().offer(credit, after_ms=after_ms)


async def test_no_credit_names_a_partition_while_it_is_being_revoked() -> None:
    """The revocation withdraws the credit and waits for the batches in hand: a credit offered meanwhile
    would draw a batch to a partition that is moving away (and the wait would cover it too)."""
    credits = OffersWhileRevoking()
    rig = Rig(credits=credits)
    consumer = RevokingConsumer(rig.bus, rig.committed)
    credits.consumer = consumer
    batch = rig.batch(["a"])
    await rig.create(batch)
    backend = ScriptedBackend(hang_on="")  # the call runs until released
    # a call expected to end at once: the loop offers the next credit while it runs
    worker = await rig.worker(backend, consumer, expected_latency_ms=1.0, hang_min_s=60.0, poll_timeout_s=0.01)
    revoking = None
    try:
        await rig.send(batch)
        await eventually(lambda: len(backend.calls) == 1, "the batch's call to start")
        revoking = asyncio.create_task(consumer.revoke(frozenset({0})))
        await eventually(lambda: consumer.fetches_while_revoking >= 5, "the loop to go round while revoking")
    finally:
        backend.release.set()
        if revoking is not None:
            await revoking
        await worker.close()
    assert credits.offered_while_revoking == [], (
        f"credits offered during the revocation: {credits.offered_while_revoking}"
    )
