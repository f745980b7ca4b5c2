"""Shared answers through the real batcher and worker (embedded runtime): collapsing at the gateway,
one computation per distinct input in a batch, and cache hits that never reach the backend."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from batchwire.embedded import EmbeddedRuntime, EmbeddedSettings
from batchwire.settings import SharedSettings
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from schemas.records import TaskStatus
from tests.support.recording_sim import RecordingSim
from transport.memory.cache import MemoryResultCache

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def system() -> AsyncIterator[tuple[Gateway, EmbeddedRuntime, RecordingSim]]:
    backend = RecordingSim(latency_ms=200)
    shared = SharedSettings(models=("sim",))
    settings = EmbeddedSettings(shared=shared, workers_per_model=1, deterministic_models=("sim",))
    runtime = EmbeddedRuntime(settings, lambda model, index: backend)
    gateway_settings = GatewaySettings(models=("sim",), deterministic_models=("sim",), cache_ttl_s=60.0)
    gateway = Gateway(gateway_settings, runtime.producer, runtime.store, cache=MemoryResultCache())
    await runtime.start()
    await gateway.start()
    try:
        yield gateway, runtime, backend
    finally:
        await gateway.close()
        await runtime.close()


async def test_duplicates_in_one_batch_run_once_and_each_task_gets_its_own_answer(
    system: tuple[Gateway, EmbeddedRuntime, RecordingSim],
) -> None:
    gateway, _, backend = system
    busy = await gateway.submit("keep the gpu busy", None, 20_000, False)
    deadline = time.monotonic() + 20
    while backend.inputs != ["keep the gpu busy"]:  # the only worker now computes for 200 ms
        assert time.monotonic() < deadline, f"the busy task did not start: {backend.inputs}"
        await asyncio.sleep(0.005)
    texts = ["dup", "one", "dup", "two", "dup"]
    accepted = [await gateway.submit(text, None, 20_000, False) for text in texts]  # wait in one batch
    states = [await gateway.result(a.task_id, wait_s=20) for a in accepted]
    assert [(s.status, s.output) for s in states] == [(TaskStatus.COMPLETED, t[::-1]) for t in texts], states
    assert len({s.task_id for s in states}) == 5, "each task keeps its id"
    assert Counter(backend.inputs)["dup"] == 1, f"the batch's duplicates ran once: {backend.inputs}"
    assert (await gateway.result(busy.task_id)).status is TaskStatus.COMPLETED


async def test_concurrent_identical_callers_share_and_then_hit_the_cache(
    system: tuple[Gateway, EmbeddedRuntime, RecordingSim],
) -> None:
    gateway, _, backend = system
    texts = [f"q{i % 3}" for i in range(30)]
    answers = await asyncio.gather(*(gateway.submit(text, None, 20_000, True) for text in texts))
    assert [a.output for a in answers] == [t[::-1] for t in texts], "every answer is its own input's"
    assert len({a.task_id for a in answers}) == 30
    assert sorted(backend.inputs) == ["q0", "q1", "q2"], f"one computation per distinct input: {backend.inputs}"

    again = await gateway.submit("q1", None, 20_000, True)
    assert (again.output, again.batch_size) == ("1q", None), "a hit: no batch ran it"
    assert sorted(backend.inputs) == ["q0", "q1", "q2"], "the hit never reached the backend"
