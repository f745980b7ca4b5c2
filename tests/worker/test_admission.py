"""Tasks move to ``running`` before the backend sees them; tasks that already ended never run."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from gpu_worker.admission import Admission, expired_error
from schemas.records import BatchItem, TaskState, TaskStatus, call_ms_named
from tests.support.eventually import eventually
from tests.support.metrics import tasks_ended
from tests.support.worker_rig import Rig, ScriptedBackend, now_ms
from transport.deliveries import MemoryDeliveryLog
from transport.errors import PermanentTransportError
from transport.memory.store import MemoryTaskStore

T = TypeVar("T")


async def test_a_cancelled_task_never_reaches_the_backend() -> None:
    rig = Rig()
    await rig.listen()
    backend = ScriptedBackend()
    worker = await rig.worker(backend)
    batch = rig.batch(["abc", "cancel me", "xyz"])
    await rig.create(batch)
    await rig.store.apply([TaskState("t1", TaskStatus.CANCELLED, "sim", now_ms(), 0, error_code="cancelled")])
    await rig.send(batch)
    ended = await rig.ended(["t0", "t2"])
    await worker.close()
    assert backend.calls == [["abc", "xyz"]], f"only live tasks reach the backend, got {backend.calls}"
    assert ended["t0"].output == "cba" and ended["t2"].output == "zyx"
    sizes = [ended["t0"].batch_size, ended["t2"].batch_size]
    assert sizes == [2, 2], f"the answers ran in a batch of 2, the cancelled task dropped; got {sizes}"
    stored = await rig.store.get("t1")
    assert stored is not None and stored.status is TaskStatus.CANCELLED, f"the cancel stands, got {stored}"


async def test_a_redelivered_batch_whose_tasks_ended_is_not_computed_again() -> None:
    rig = Rig()
    await rig.listen()
    backend = ScriptedBackend()
    worker = await rig.worker(backend)
    batch = rig.batch(["one", "two"])
    await rig.create(batch)
    await rig.send(batch)
    await rig.ended(["t0", "t1"])
    await rig.send(batch)  # the commit was lost, say: the same batch comes again
    await eventually(lambda: worker.batches_done == 2, "the redelivery to be handled")
    await worker.close()
    assert backend.calls == [["one", "two"]], f"ended tasks must not run twice, got {backend.calls}"
    assert {task: len(states) for task, states in rig.replies.items()} == {"t0": 1, "t1": 1}


async def test_a_task_left_running_by_a_dead_worker_runs_again() -> None:
    rig = Rig()
    await rig.listen()
    backend = ScriptedBackend()
    batch = rig.batch(["left"])
    await rig.create(batch)
    await rig.store.apply([TaskState("t0", TaskStatus.RUNNING, "sim", now_ms(), 0, worker_id="dead")])
    await rig.deliveries.begin(batch.batch_id, "died")  # the dead worker's delivery
    worker = await rig.worker(backend)
    await rig.send(batch)
    ended = await rig.ended(["t0"])
    await worker.close()
    assert ended["t0"].status is TaskStatus.COMPLETED and ended["t0"].output == "tfel"


class OrderedStore(MemoryTaskStore):
    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    async def apply(self, updates: Sequence[TaskState]) -> list[bool]:
        applied = await super().apply(updates)
        self.events.extend(f"stored {state.status.value}" for state in updates)
        return applied


class OrderedBackend(ScriptedBackend):
    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def batchstring(self, inputs: list[str]) -> list[str]:
        self.events.append("backend")
        return super().batchstring(inputs)


async def test_running_is_stored_before_the_backend_is_called() -> None:
    events: list[str] = []
    rig = Rig(store=OrderedStore(events))
    await rig.listen()
    worker = await rig.worker(OrderedBackend(events))
    batch = rig.batch(["a"])
    await rig.create(batch)
    await rig.send(batch)
    await rig.ended(["t0"])
    await worker.close()
    assert events == ["stored running", "backend", "stored completed"], events


async def test_an_expiry_at_admission_is_counted_once_when_the_batch_comes_again() -> None:
    """The batch comes again (its commit was lost, say): its item past its deadline is expired again at
    admission, a write the store refuses, and its end is not counted a second time."""
    rig = Rig()
    await rig.listen()
    worker = await rig.worker(ScriptedBackend())
    before = tasks_ended("expired")
    batch = rig.batch(["late"], deadline_ms=now_ms() - 1_000)
    await rig.create(batch)
    await rig.send(batch)
    ended = await rig.ended(["t0"])
    assert ended["t0"].status is TaskStatus.EXPIRED, ended
    await eventually(lambda: rig.committed == [0], "the first delivery to be committed")
    await rig.send(batch)
    await eventually(lambda: rig.committed == [0, 1], "the second delivery to be committed")
    await worker.close()
    assert rig.replies["t0"] == [ended["t0"]], f"one end: {rig.replies['t0']}"
    assert tasks_ended("expired") - before == 1, f"one end, counted once; counted {tasks_ended('expired') - before}"


class StuckDeliveries(MemoryDeliveryLog):
    """Counts a delivery only once ``answer`` is set (a Redis round trip that hangs); notes its end."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()
        self.counting = asyncio.Event()
        self.ended: str | None = None

    async def begin(self, batch_id: str, receipt: str) -> int:
        self.counting.set()
        try:
            await self.answer.wait()
        except asyncio.CancelledError:
            self.ended = "cancelled"
            raise
        self.ended = "counted"
        return await super().begin(batch_id, receipt)


class RefusingStore(MemoryTaskStore):
    async def apply(self, updates: Sequence[TaskState], *, counted: bool = True) -> list[bool]:
        raise PermanentTransportError("the store refuses the write (a script error)")


async def test_an_admission_that_fails_leaves_no_delivery_count_running_behind_it() -> None:
    """The count and the move to ``running`` go together: when one fails, the other is stopped, not
    left running on its own after the worker gave the batch up."""

    async def once(what: str, op: Callable[[], Awaitable[T]]) -> T:
        return await op()

    deliveries = StuckDeliveries()
    admission = Admission("w", RefusingStore(), deliveries, once, keep_ended=False)
    batch = Rig().batch(["one"])
    refused: list[Exception] = []
    try:
        await admission.count_and_admit(batch, list(batch.items), "r1")
    except* PermanentTransportError as errors:
        refused.extend(errors.exceptions)
    assert refused, "the store's refusal comes out"
    assert deliveries.counting.is_set(), "the count had begun"
    assert deliveries.ended == "cancelled", f"the count is stopped with the admission, got {deliveries.ended}"


def test_a_timeout_shorter_than_a_call_is_named_as_what_was_left_of_it_when_sent() -> None:
    """An item carries what was left of its caller's timeout when the gateway sent it (admission's waits
    spent), not the timeout_ms sent: the message gives that figure as such, so a caller who sent 1000 is
    not told its timeout was 997."""
    item = BatchItem("t0", "a", enqueued_at_ms=10_000, deadline_ms=10_997)
    message = expired_error(item, call_ms=5000.0).message
    assert "timeout (about 997 ms" not in message, f"997 ms is not the timeout the caller sent: {message}"
    assert "left of the request's timeout when the gateway sent it (997 ms" in message, message
    assert call_ms_named(message) == 5000, f"the gateway still reads the call's length: {message}"
