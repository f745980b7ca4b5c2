"""A worker over in-memory transports, and backends that fail in the ways real ones do."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpu_worker.backends.base import InputError
from gpu_worker.settings import WorkerSettings
from gpu_worker.worker import Worker
from schemas.records import Batch, BatchItem, TaskState, TaskStatus
from transport.deliveries import MemoryDeadLetters, MemoryDeliveryLog
from transport.memory.bus import MemoryBatchBus, MemoryCreditPool, MemoryTaskStore


class Died(BaseException):
    """Stands for the death of a worker process (a segfault, kill -9): nothing in the worker catches it."""


class ScriptedBackend:
    """Reverses inputs; dies on inputs containing ``die_on``, hangs on ``hang_on``; records every call."""

    name = "scripted"
    max_batch = 100

    def __init__(self, die_on: str | None = None, hang_on: str | None = None, latency_s: float = 0.0) -> None:
        self.die_on = die_on
        self.hang_on = hang_on
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
        return [text[::-1] for text in inputs]

    def close(self) -> None:
        self.closed = True


def now_ms() -> int:
    return int(time.time() * 1000)


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

    async def listen(self) -> None:
        def on_reply(state: TaskState) -> None:
            self.replies.setdefault(state.task_id, []).append(state)
            self.replied.set()

        await self.store.listen_replies("gw", on_reply)

    async def worker(self, backend: ScriptedBackend, **settings: object) -> Worker:
        self.generation += 1
        worker = Worker(
            WorkerSettings(worker_id=f"w{self.generation}", **settings),  # type: ignore[arg-type]
            self.bus.consumer(0),
            self.credits,
            self.store,
            backend,
            deliveries=self.deliveries,
            dead_letters=self.dead_letters,
        )
        await worker.start()
        return worker

    def batch(self, inputs: Sequence[str], batch_id: str = "b1", deadline_ms: int | None = None) -> Batch:
        now = now_ms()
        items = tuple(BatchItem(f"t{i}", text, now, deadline_ms or now + 30_000, "gw") for i, text in enumerate(inputs))
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


async def until(check: object, what: str, timeout_s: float = 10.0) -> None:
    """Polls ``check()`` every 5 ms until it holds; fails naming ``what`` after ``timeout_s``."""
    assert callable(check)
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.005)
