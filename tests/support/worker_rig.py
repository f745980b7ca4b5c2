"""A worker over in-memory transports, and backends that fail in the ways real ones do."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpu_worker.backends.base import BackendError, InputError
from gpu_worker.settings import WorkerSettings
from gpu_worker.worker import Worker
from schemas.records import Batch, BatchItem, TaskState, TaskStatus
from transport.deliveries import MemoryDeadLetters, MemoryDeliveryLog
from transport.memory.batches import MemoryBatchBus, MemoryBatchConsumer
from transport.memory.credits import MemoryCreditPool
from transport.memory.store import MemoryTaskStore
from transport.ports import Delivered


class Died(BaseException):
    """Stands for the death of a worker process (a segfault, kill -9): nothing in the worker catches it."""


class ScriptedBackend:
    """Reverses inputs; dies on inputs containing ``die_on``, hangs on ``hang_on``, fails a call
    with one containing ``fail_on`` (after its latency); records every call."""

    name = "scripted"
    max_batch = 100

    def __init__(
        self,
        die_on: str | None = None,
        hang_on: str | None = None,
        latency_s: float = 0.0,
        fail_on: str | None = None,
    ) -> None:
        self.die_on = die_on
        self.hang_on = hang_on
        self.fail_on = fail_on
        self.latency_s = latency_s
        self.calls: list[list[str]] = []
        self.release = threading.Event()
        self.closed = False

    def load(self) -> None:
        return None

    def input_errors(self, inputs: Sequence[str]) -> dict[int, InputError]:
        return {}

    def batchstring(self, inputs: list[str]) -> list[str]:
        self.calls.append(list(inputs))
        if self.die_on is not None and any(self.die_on in text for text in inputs):
            raise Died(f"died on {inputs}")
        if self.hang_on is not None and any(self.hang_on in text for text in inputs):
            self.release.wait()
        if self.latency_s:
            time.sleep(self.latency_s)
        if self.fail_on is not None and any(self.fail_on in text for text in inputs):
            raise BackendError(f"failed on {inputs}")
        return [text[::-1] for text in inputs]

    def close(self) -> None:
        self.closed = True


class PoisonBackend:
    """Fails any call that contains an input starting with 'poison'; counts calls."""

    name = "poison"
    max_batch = 100

    def __init__(self) -> None:
        self.calls: list[int] = []

    def load(self) -> None:
        return None

    def input_errors(self, inputs: Sequence[str]) -> dict[int, InputError]:
        return {i: InputError(i, "input_too_long", "too long") for i, text in enumerate(inputs) if len(text) > 50}

    def batchstring(self, inputs: list[str]) -> list[str]:
        self.calls.append(len(inputs))
        if any(text.startswith("poison") for text in inputs):
            raise BackendError("model blew up")
        return [text.upper() for text in inputs]

    def close(self) -> None:
        return None


def now_ms() -> int:
    """Wall time in ms, as records carry it."""
    return int(time.time() * 1000)


class RecordingConsumer(MemoryBatchConsumer):
    """Records the offsets committed, in order."""

    def __init__(self, bus: MemoryBatchBus, committed: list[int]) -> None:
        super().__init__(bus, 0)
        self.committed = committed

    async def commit(self, delivered: Delivered[Batch]) -> None:
        self.committed.append(delivered.offset)


@dataclass
class Rig:
    """One batch partition, a store, a credit pool and a delivery log that outlive the workers on them."""

    store: MemoryTaskStore = field(default_factory=MemoryTaskStore)
    credits: MemoryCreditPool = field(default_factory=MemoryCreditPool)
    bus: MemoryBatchBus = field(default_factory=lambda: MemoryBatchBus(1))
    deliveries: MemoryDeliveryLog = field(default_factory=MemoryDeliveryLog)
    dead_letters: MemoryDeadLetters = field(default_factory=MemoryDeadLetters)
    replies: dict[str, list[TaskState]] = field(default_factory=dict)
    replied: asyncio.Event = field(default_factory=asyncio.Event)
    generation: int = 0
    committed: list[int] = field(default_factory=list)
    """Offsets committed, by every worker on the partition."""

    async def listen(self) -> None:
        def on_reply(state: TaskState) -> None:
            self.replies.setdefault(state.task_id, []).append(state)
            self.replied.set()

        await self.store.listen_replies("gw", on_reply)

    async def worker(
        self, backend: ScriptedBackend, consumer: RecordingConsumer | None = None, **settings: object
    ) -> Worker:
        """A started worker on the partition (``consumer``: one of the test's own, recording as the rig's)."""
        self.generation += 1
        worker = Worker(
            WorkerSettings(worker_id=f"w{self.generation}", **settings),  # type: ignore[arg-type]
            consumer or RecordingConsumer(self.bus, self.committed),
            self.credits,
            self.store,
            backend,
            deliveries=self.deliveries,
            dead_letters=self.dead_letters,
        )
        await worker.start()
        return worker

    def batch(
        self, inputs: Sequence[str], batch_id: str = "b1", deadline_ms: int | None = None, prefix: str = "t"
    ) -> Batch:
        """Task ids ``prefix`` and the input's index."""
        now = now_ms()
        deadline = deadline_ms or now + 30_000
        items = tuple(BatchItem(f"{prefix}{i}", text, now, deadline, "gw") for i, text in enumerate(inputs))
        return Batch(batch_id, "sim", "test", now, "idle_worker", None, items)

    async def create(self, batch: Batch) -> None:
        for item in batch.items:
            await self.store.create(TaskState(item.task_id, TaskStatus.QUEUED, "sim", now_ms(), item.enqueued_at_ms))

    async def send(self, batch: Batch) -> None:
        await self.bus.send(batch, 0)

    async def ended(self, task_ids: Sequence[str], timeout_s: float = 10.0) -> dict[str, TaskState]:
        """Waits until each task has a terminal reply; returns the first one of each."""
        async with asyncio.timeout(timeout_s):
            while not all(task_id in self.replies for task_id in task_ids):
                self.replied.clear()
                await self.replied.wait()
        return {task_id: self.replies[task_id][0] for task_id in task_ids}


async def run_batch(
    inputs: list[str],
    deadline_ms: int | None = None,
    settings: WorkerSettings | None = None,
    *,
    enqueued_ago_ms: int = 0,
) -> tuple[dict[str, TaskState], PoisonBackend]:
    """Runs one batch of ``inputs`` on a fresh worker over a ``PoisonBackend``; returns each task's reply."""
    store = MemoryTaskStore()
    credits = MemoryCreditPool()
    bus = MemoryBatchBus(1)
    backend = PoisonBackend()
    worker = Worker(settings or WorkerSettings(worker_id="w1"), bus.consumer(0), credits, store, backend)
    await worker.start()
    credit = await credits.claim("sim", 5)
    assert credit is not None and credit.worker_id == "w1", "an idle worker offers a credit"
    ended: dict[str, TaskState] = {}
    done = asyncio.Event()

    def on_reply(state: TaskState) -> None:
        ended[state.task_id] = state
        if len(ended) == len(inputs):
            done.set()

    await store.listen_replies("gw", on_reply)
    now = now_ms()
    enqueued = now - enqueued_ago_ms
    items = tuple(
        BatchItem(f"t{i}", text, enqueued, deadline_ms or now + 30_000, "gw") for i, text in enumerate(inputs)
    )
    await bus.send(Batch("b1", "sim", "test", now, "idle_worker", credit.ref, items), credit.partition)
    await asyncio.wait_for(done.wait(), 10)
    await worker.close()
    return ended, backend
