"""Embedded mode: a worker whose backend hangs is replaced in process and its batch goes back."""

from __future__ import annotations

import asyncio
import time

from batchwire.embedded import EmbeddedRuntime, EmbeddedSettings
from gpu_worker.backends.sim import SimBackend
from gpu_worker.settings import WorkerSettings
from schemas.deadletter import DEAD_LETTERED
from schemas.records import Batch, InferenceRequest, TaskState, TaskStatus
from telemetry import metrics
from transport.memory.batches import MemoryBatchBus


async def test_a_hung_worker_is_replaced_and_only_the_hanging_input_is_set_aside() -> None:
    backends: list[SimBackend] = []

    def backend(model: str, index: int) -> SimBackend:
        backends.append(SimBackend(latency_ms=20, hang_on="hang"))
        return backends[-1]

    settings = EmbeddedSettings(worker=WorkerSettings(hang_min_s=0.3, expected_latency_ms=20))
    runtime = EmbeddedRuntime(settings, backend)
    await runtime.start()
    replies: dict[str, list[TaskState]] = {}
    changed = asyncio.Event()

    def on_reply(state: TaskState) -> None:
        replies.setdefault(state.task_id, []).append(state)
        changed.set()

    await runtime.store.listen_replies("gw", on_reply)
    inputs = {"a": "fine one", "b": "hang here", "c": "fine two"}
    now = int(time.time() * 1000)
    for task_id, text in inputs.items():
        await runtime.store.create(TaskState(task_id, TaskStatus.QUEUED, "sim", now, now, reply_to="gw"))
        await runtime.producer.send(InferenceRequest(task_id, "sim", text, now, now + 30_000, reply_to="gw"))
    async with asyncio.timeout(20):
        while len(replies) < len(inputs):
            changed.clear()
            await changed.wait()
    try:
        assert {task: len(states) for task, states in replies.items()} == {"a": 1, "b": 1, "c": 1}
        assert replies["a"][0].output == "eno enif" and replies["c"][0].output == "owt enif"
        assert replies["b"][0].status is TaskStatus.FAILED and replies["b"][0].error_code == DEAD_LETTERED
        message = replies["b"][0].error_message or ""
        assert "topic" not in message and "memory" in message, f"embedded mode has no dead-letter topic: {message}"
        assert runtime.replaced >= 3, f"each hang replaces a worker; {runtime.replaced} replaced"
        assert [item.input for letter in runtime.dead_letters.letters for item in letter.items] == ["hang here"]
        assert all((await runtime.ready()).values()), "the replacements serve"
        replaced = {worker.settings.worker_id for worker in runtime._retired}  # no heartbeats took them
        labelled = {
            sample.labels["worker"]
            for family in metrics.REGISTRY.collect()
            for sample in family.samples
            if family.name.startswith("batchwire_worker_") and "worker" in sample.labels
        }
        assert replaced and not replaced & labelled, f"replaced workers' series stay: {sorted(replaced & labelled)}"
    finally:
        await runtime.close()


async def test_batches_given_back_go_ahead_of_those_sent_since() -> None:
    """A replacement meets the batches its predecessor never finished first, as over Kafka, where it reads
    from the committed offset: they are older, their deadlines nearer."""
    bus = MemoryBatchBus(1)
    now = int(time.time() * 1000)

    def batch(batch_id: str) -> Batch:
        return Batch(batch_id, "sim", "test", now, "idle_worker")

    await bus.send(batch("sent-since"), 0)
    await bus.send_again([batch("taken-first"), batch("taken-second")], 0)
    consumer = bus.consumer(0)
    order = []
    for _ in range(3):
        delivered = await consumer.next(1.0)
        assert delivered is not None and delivered.value is not None, "three batches wait"
        order.append(delivered.value.batch_id)
    assert order == ["taken-first", "taken-second", "sent-since"]


async def test_a_replacement_allows_its_predecessors_hang_limit_so_the_hanging_input_is_set_aside_in_time() -> None:
    """No --expected-latency-ms: the replacement's first call runs the batch its predecessor hung on. Allowed
    the 60 s of a worker that has timed nothing, it would hang past every deadline of that batch, and the
    hanging input would end ``expired`` instead of dead-lettered, its batch's other inputs with it."""
    settings = EmbeddedSettings(workers_per_model=1, worker=WorkerSettings(hang_min_s=0.3))
    runtime = EmbeddedRuntime(settings, lambda model, index: SimBackend(latency_ms=20, hang_on="hang"))
    await runtime.start()
    replies: dict[str, TaskState] = {}
    changed = asyncio.Event()

    def on_reply(state: TaskState) -> None:
        replies[state.task_id] = state
        changed.set()

    async def answered(task_ids: set[str]) -> None:
        while not task_ids <= replies.keys():
            changed.clear()
            await changed.wait()

    async def send(task_id: str, text: str) -> None:
        now = int(time.time() * 1000)
        await runtime.store.create(TaskState(task_id, TaskStatus.QUEUED, "sim", now, now, reply_to="gw"))
        await runtime.producer.send(InferenceRequest(task_id, "sim", text, now, now + 10_000, reply_to="gw"))

    await runtime.store.listen_replies("gw", on_reply)
    try:
        for n in range(3):  # the worker times its calls
            await send(f"warm-{n}", "warm")
            async with asyncio.timeout(10):
                await answered({f"warm-{n}"})
        inputs = {"a": "fine one", "b": "hang here", "c": "fine two", "d": "fine three"}
        for task_id, text in inputs.items():
            await send(task_id, text)
        try:
            async with asyncio.timeout(15):
                await answered(set(inputs))
        except TimeoutError:
            limits = [worker.runner.limit_s() for worker in runtime.workers]
            raise AssertionError(f"not every input answered within 15 s: {replies}; hang limits now {limits}") from None
        for task_id in ("a", "c", "d"):
            assert replies[task_id].output == inputs[task_id][::-1], f"{task_id} answered: {replies[task_id]}"
        assert replies["b"].error_code == DEAD_LETTERED, f"the hanging input is set aside: {replies['b']}"
    finally:
        await runtime.close()
