"""Tasks move to ``running`` before the backend sees them; tasks that already ended never run. An
express batch to an idle worker is the exception: its call starts while its tasks are admitted."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from gpu_worker.settings import WorkerSettings
from gpu_worker.worker import Worker
from schemas.records import Batch, TaskState, TaskStatus
from tests.support.eventually import eventually
from tests.support.worker_rig import Rig, ScriptedBackend, now_ms
from transport.memory.bus import MemoryTaskStore
from transport.ports import UNKNOWN, BatchConsumer, Delivered, PartitionsCallback


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
    await rig.deliveries.begin(batch.batch_id)  # the dead worker's delivery
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


class ExpressCopies:
    """The rig's batch partition read as express copies, as ``ExpressBatchConsumer`` hands them on:
    each batch's first and only delivery from its batcher."""

    def __init__(self, inner: BatchConsumer) -> None:
        self.inner = inner

    async def start(self, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback) -> None:
        await self.inner.start(on_assigned, on_revoked)

    async def close(self) -> None:
        await self.inner.close()

    async def next(self, timeout_s: float) -> Delivered[Batch] | None:
        delivered = await self.inner.next(timeout_s)
        return None if delivered is None else Delivered(delivered.value, UNKNOWN, UNKNOWN, via="express")

    async def commit(self, delivered: Delivered[Batch]) -> None:
        return None

    def assignment(self) -> frozenset[int]:
        return self.inner.assignment()


class GatedStore(MemoryTaskStore):
    """Holds every ``running`` write until ``gate`` opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.held = 0

    async def apply(self, updates: Sequence[TaskState]) -> list[bool]:
        if any(state.status is TaskStatus.RUNNING for state in updates):
            self.held += 1
            await self.gate.wait()
        return await super().apply(updates)


async def express_worker(rig: Rig, backend: ScriptedBackend) -> Worker:
    worker = Worker(
        WorkerSettings(worker_id="w1"),
        ExpressCopies(rig.bus.consumer(0)),
        rig.credits,
        rig.store,
        backend,
        deliveries=rig.deliveries,
    )
    await worker.start()
    return worker


async def test_an_express_batch_to_an_idle_worker_runs_while_its_tasks_are_admitted() -> None:
    store = GatedStore()
    rig = Rig(store=store)
    await rig.listen()
    backend = ScriptedBackend()
    worker = await express_worker(rig, backend)
    batch = rig.batch(["abc", "xyz"])
    await rig.create(batch)
    await rig.send(batch)
    await eventually(lambda: backend.calls, "the call to start while the running write is held")
    assert store.held == 1 and rig.replies == {}, "admitted after the call began, answered after both"
    store.gate.set()
    ended = await rig.ended(["t0", "t1"])
    await worker.close()
    assert backend.calls == [["abc", "xyz"]]
    assert [ended["t0"].output, ended["t1"].output] == ["cba", "zyx"]


async def test_an_express_batch_drops_the_result_of_a_task_cancelled_before_its_admission() -> None:
    rig = Rig()
    await rig.listen()
    backend = ScriptedBackend()
    worker = await express_worker(rig, backend)
    batch = rig.batch(["abc", "cancel me", "xyz"])
    await rig.create(batch)
    await rig.store.apply([TaskState("t1", TaskStatus.CANCELLED, "sim", now_ms(), 0, error_code="cancelled")])
    await rig.send(batch)
    ended = await rig.ended(["t0", "t2"])
    await eventually(lambda: worker.batches_done == 1, "the batch to be finished")
    await worker.close()
    assert backend.calls == [["abc", "cancel me", "xyz"]], "computed before its admission was known"
    assert ended["t0"].output == "cba" and ended["t2"].output == "zyx"
    assert "t1" not in rig.replies, f"no answer for a cancelled task, got {rig.replies.get('t1')}"
    stored = await rig.store.get("t1")
    assert stored is not None and stored.status is TaskStatus.CANCELLED, f"the cancel stands, got {stored}"
