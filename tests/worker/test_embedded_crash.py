"""Embedded mode: a worker that crashes is replaced in process after a backoff, as a supervisor restarts a
crashed worker process, and the batch it had not committed runs again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from batchwire.embedded import EmbeddedRuntime, EmbeddedSettings
from gpu_worker.backends.sim import SimBackend
from schemas.records import InferenceRequest, TaskState, TaskStatus
from transport.ports import TransportError


class _Refused(TransportError):
    retriable = False


async def test_a_crashed_worker_is_replaced_after_a_backoff_and_its_batch_runs_again() -> None:
    runtime = EmbeddedRuntime(EmbeddedSettings(workers_per_model=1), lambda model, index: SimBackend(latency_ms=5))
    apply = runtime.store.apply
    refusals = 0

    async def refuse_once(updates: Sequence[TaskState]) -> list[bool]:
        nonlocal refusals
        if refusals == 0 and any(state.status.terminal for state in updates):
            refusals += 1
            raise _Refused("a store fault that retrying cannot fix")  # the worker stops: it crashed
        return await apply(updates)

    runtime.store.apply = refuse_once  # type: ignore[method-assign]
    await runtime.start()
    answered = asyncio.Event()
    replies: list[TaskState] = []

    def on_reply(state: TaskState) -> None:
        replies.append(state)
        answered.set()

    try:
        await runtime.store.listen_replies("gw", on_reply)
        crashed = runtime.workers[0]
        now = int(time.time() * 1000)
        await runtime.store.create(TaskState("a", TaskStatus.QUEUED, "sim", now, now, reply_to="gw"))
        await runtime.producer.send(InferenceRequest("a", "sim", "hello", now, now + 30_000, reply_to="gw"))
        async with asyncio.timeout(20):
            await crashed.failed.wait()
            assert not (await runtime.ready())["workers"], "unready while the crashed worker is down"
            await answered.wait()
        assert refusals == 1
        assert [(state.task_id, state.status, state.output) for state in replies] == [
            ("a", TaskStatus.COMPLETED, "olleh")
        ], "the batch the crashed worker held runs again on its replacement, and is answered once"
        assert runtime.workers[0] is not crashed and runtime.replaced == 1
        assert all((await runtime.ready()).values()), "the replacement serves"
    finally:
        await runtime.close()
