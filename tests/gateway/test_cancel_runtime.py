"""A cancelled task never reaches the GPU: the gateway over the embedded runtime (real batcher and worker)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from batchwire.embedded import EmbeddedRuntime, EmbeddedSettings
from batchwire.settings import SharedSettings
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from schemas.records import TaskState, TaskStatus
from tests.support.recording_sim import RecordingSim

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def system() -> AsyncIterator[tuple[Gateway, EmbeddedRuntime, RecordingSim]]:
    backend = RecordingSim(latency_ms=400)
    runtime = EmbeddedRuntime(
        EmbeddedSettings(shared=SharedSettings(models=("sim",)), workers_per_model=1), lambda model, index: backend
    )
    gateway = Gateway(GatewaySettings(models=("sim",)), runtime.producer, runtime.store)
    await runtime.start()
    await gateway.start()
    try:
        yield gateway, runtime, backend
    finally:
        await gateway.close()
        await runtime.close()


async def _status_becomes(runtime: EmbeddedRuntime, task_id: str, status: TaskStatus) -> None:
    deadline = time.monotonic() + 20
    while True:
        state = await runtime.store.get(task_id)
        if state is not None and state.status is status:
            return
        assert time.monotonic() < deadline, f"task {task_id} is {state}, expected {status.value}"
        await asyncio.sleep(0.01)


async def test_a_cancelled_task_is_never_running_completed_nor_computed(
    system: tuple[Gateway, EmbeddedRuntime, RecordingSim],
) -> None:
    gateway, runtime, backend = system
    busy = await gateway.submit("keep the gpu busy", None, 20_000, False)
    await _status_becomes(runtime, busy.task_id, TaskStatus.RUNNING)  # the only worker is now busy for 400 ms

    doomed = await gateway.submit("doomed", None, 20_000, False)
    seen: list[TaskState] = []
    async with runtime.store.watch(doomed.task_id) as changes:
        cancelled = await gateway.cancel(doomed.task_id)
        assert cancelled.status is TaskStatus.CANCELLED, cancelled
        # Queued behind the cancelled task: once it is answered, the cancelled one has had its turn.
        after = await asyncio.wait_for(gateway.submit("after", None, 20_000, True), 20)
        assert after.output == "retfa"
        while True:
            try:
                seen.append(await asyncio.wait_for(anext(changes), 0.2))
            except TimeoutError:
                break

    statuses = [state.status for state in seen]
    assert TaskStatus.RUNNING not in statuses, f"the cancelled task ran: {statuses}"
    assert TaskStatus.COMPLETED not in statuses, f"the cancelled task completed: {statuses}"
    final = await gateway.result(doomed.task_id)
    assert final.status is TaskStatus.CANCELLED, final
    assert "doomed" not in backend.inputs, f"the GPU saw the cancelled input: {backend.inputs}"
    assert {"keep the gpu busy", "after"} <= set(backend.inputs), backend.inputs
