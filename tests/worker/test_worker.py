"""The worker loop over in-memory transports: one batch at a time, poison isolation, statuses."""

from __future__ import annotations

import asyncio
import time

from batchwire.transport.memory import MemoryBatchBus, MemoryCreditPool, MemoryTaskStore
from gpu_worker.backends.base import BackendError, InputError
from gpu_worker.settings import WorkerSettings
from gpu_worker.worker import Worker
from schemas.records import Batch, BatchItem, TaskState, TaskStatus


class PoisonBackend:
    """Fails any call that contains an input starting with 'poison'; counts calls."""

    name = "poison"
    max_batch = 100

    def __init__(self) -> None:
        self.calls: list[int] = []

    def load(self) -> None:
        return None

    def input_errors(self, inputs: list[str]) -> dict[int, InputError]:
        return {i: InputError(i, "input_too_long", "too long") for i, text in enumerate(inputs) if len(text) > 50}

    def batchstring(self, inputs: list[str]) -> list[str]:
        self.calls.append(len(inputs))
        if any(text.startswith("poison") for text in inputs):
            raise BackendError("model blew up")
        return [text.upper() for text in inputs]

    def close(self) -> None:
        return None


def now_ms() -> int:
    return int(time.time() * 1000)


async def run_batch(inputs: list[str], deadline_ms: int | None = None) -> tuple[dict[str, TaskState], PoisonBackend]:
    store = MemoryTaskStore()
    credits = MemoryCreditPool()
    bus = MemoryBatchBus(1)
    backend = PoisonBackend()
    worker = Worker(WorkerSettings(worker_id="w1"), bus.consumer(0), credits, store, backend)
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
    items = tuple(BatchItem(f"t{i}", text, now, deadline_ms or now + 30_000, "gw") for i, text in enumerate(inputs))
    await bus.send(Batch("b1", "sim", "test", now, "idle_worker", credit.ref, items), credit.partition)
    await asyncio.wait_for(done.wait(), 10)
    await worker.close()
    return ended, backend


async def test_healthy_batch_completes_in_order() -> None:
    ended, backend = await run_batch(["a", "b", "c"])
    assert {k: (v.status, v.output) for k, v in ended.items()} == {
        "t0": (TaskStatus.COMPLETED, "A"),
        "t1": (TaskStatus.COMPLETED, "B"),
        "t2": (TaskStatus.COMPLETED, "C"),
    }
    assert backend.calls == [3]
    assert all(state.batch_size == 3 and state.worker_id == "w1" for state in ended.values())


async def test_a_poison_input_is_isolated_by_bisection() -> None:
    inputs = [f"ok{i}" for i in range(7)] + ["poison!"]
    ended, backend = await run_batch(inputs)
    failed = {k for k, v in ended.items() if v.status is TaskStatus.FAILED}
    assert failed == {"t7"}, f"only the poison input should fail, got {failed}"
    assert ended["t7"].error_code == "backend_error"
    assert "blew up" in (ended["t7"].error_message or "")
    assert all(ended[f"t{i}"].output == f"OK{i}" for i in range(7))
    assert backend.calls[0] == 8 and len(backend.calls) <= 1 + 2 * 3, "bisection stays logarithmic"


async def test_inputs_rejected_up_front_fail_alone() -> None:
    ended, backend = await run_batch(["short", "x" * 60])
    assert ended["t0"].status is TaskStatus.COMPLETED
    assert ended["t1"].status is TaskStatus.FAILED
    assert ended["t1"].error_code == "input_too_long"
    assert backend.calls == [1]


async def test_expired_items_never_reach_the_backend() -> None:
    ended, backend = await run_batch(["a", "b"], deadline_ms=now_ms() - 1)
    assert {v.status for v in ended.values()} == {TaskStatus.EXPIRED}
    assert backend.calls == []
