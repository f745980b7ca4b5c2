"""A worker offers a credit only when no batch waits for it: a batch already on its way (sent against
an earlier credit, as when its group forms under load) is taken first, so the worker never runs one
batch behind, each batch waiting a call longer than it needs."""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import replace

from schemas.records import Credit
from tests.support.worker_rig import Rig, ScriptedBackend
from transport.memory.credits import MemoryCreditPool


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
