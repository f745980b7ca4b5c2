"""Embedded mode: a worker whose backend hangs is replaced in process and its batch goes back."""

from __future__ import annotations

import asyncio
import time

from batchwire.embedded import EmbeddedRuntime, EmbeddedSettings
from gpu_worker.backends.sim import SimBackend
from gpu_worker.settings import WorkerSettings
from schemas.deadletter import DEAD_LETTERED
from schemas.records import InferenceRequest, TaskState, TaskStatus


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
    finally:
        await runtime.close()
