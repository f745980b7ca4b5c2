"""Embedded mode: a worker that crashes is replaced in process after a backoff, as a supervisor restarts a
crashed worker process, and the batch it had not committed runs again."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from batchwire import embedded
from batchwire.embedded import CRASH_BACKOFF_MAX_S, EmbeddedRuntime, EmbeddedSettings, crash_backoff_s
from batchwire.settings import SharedSettings
from gpu_worker.backends.sim import SimBackend
from gpu_worker.worker import Worker
from schemas.records import InferenceRequest, TaskState, TaskStatus
from telemetry.metrics import REGISTRY
from transport.ports import TransportError


class _Refused(TransportError):
    retriable = False


def _refuse_results(runtime: EmbeddedRuntime, times: float) -> list[int]:
    """The store refuses the first ``times`` writes of results with an error that retrying cannot fix
    (the worker stops: it crashed); the list holds how many it refused."""
    apply, refused = runtime.store.apply, [0]

    async def refusing(updates: Sequence[TaskState], *, counted: bool = True) -> list[bool]:
        if refused[0] < times and any(state.status.terminal for state in updates):
            refused[0] += 1
            raise _Refused("a store fault that retrying cannot fix")
        return await apply(updates, counted=counted)

    runtime.store.apply = refusing  # type: ignore[method-assign]
    return refused


async def _submit(runtime: EmbeddedRuntime) -> None:
    now = int(time.time() * 1000)
    await runtime.store.create(TaskState("a", TaskStatus.QUEUED, "sim", now, now, reply_to="gw"))
    await runtime.producer.send(InferenceRequest("a", "sim", "hello", now, now + 30_000, reply_to="gw"))


async def test_a_crashed_worker_is_replaced_after_a_backoff_and_its_batch_runs_again() -> None:
    runtime = EmbeddedRuntime(EmbeddedSettings(workers_per_model=1), lambda model, index: SimBackend(latency_ms=5))
    refusals = _refuse_results(runtime, 1)
    await runtime.start()
    answered = asyncio.Event()
    replies: list[TaskState] = []

    def on_reply(state: TaskState) -> None:
        replies.append(state)
        answered.set()

    try:
        await runtime.store.listen_replies("gw", on_reply)
        crashed = runtime.workers[0]
        await _submit(runtime)
        async with asyncio.timeout(20):
            await crashed.failed.wait()
            assert not (await runtime.ready())["workers"], "unready while the crashed worker is down"
            await answered.wait()
        assert refusals == [1]
        assert [(state.task_id, state.status, state.output) for state in replies] == [
            ("a", TaskStatus.COMPLETED, "olleh")
        ], "the batch the crashed worker held runs again on its replacement, and is answered once"
        assert runtime.workers[0] is not crashed and runtime.replaced == 1
        assert all((await runtime.ready()).values()), "the replacement serves"
    finally:
        await runtime.close()


class _LoadFails(SimBackend):
    def load(self) -> None:
        raise RuntimeError("out of GPU memory while loading")


async def test_a_replacement_that_cannot_start_is_retried_after_a_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load that fails is one more crash in a row, not the end of the slot's replacements."""
    monkeypatch.setattr(embedded, "CRASH_BACKOFF_S", 0.01)
    made: list[SimBackend] = []

    def backend(model: str, index: int) -> SimBackend:
        made.append(_LoadFails(latency_ms=5) if len(made) in (1, 2) else SimBackend(latency_ms=5))
        return made[-1]

    runtime = EmbeddedRuntime(EmbeddedSettings(workers_per_model=1), backend)
    _refuse_results(runtime, 1)
    await runtime.start()
    answered = asyncio.Event()
    try:
        await runtime.store.listen_replies("gw", lambda state: answered.set())
        await _submit(runtime)
        async with asyncio.timeout(20):
            await answered.wait()
        assert len(made) == 4 and runtime.replaced == 1, "two replacements failed to load; the third serves"
        assert all((await runtime.ready()).values())
    finally:
        await runtime.close()


def test_the_backoff_doubles_with_each_crash_in_a_row_up_to_its_cap() -> None:
    assert [crash_backoff_s(n) for n in (1, 2, 3)] == [1.0, 2.0, 4.0]
    assert crash_backoff_s(7) == CRASH_BACKOFF_MAX_S == crash_backoff_s(10_000), "capped, never an overflow"


async def test_shutdown_while_a_slot_waits_to_replace_its_worker_closes_each_worker_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The crashed worker, closed by its watcher before a replacement that does not load, is not closed
    again by the shutdown; each replacement that did not load is closed once."""
    monkeypatch.setattr(embedded, "CRASH_BACKOFF_S", 0.01)
    closes: list[int] = []
    made: list[SimBackend] = []
    tried = asyncio.Event()

    class Counted(SimBackend):
        def load(self) -> None:
            if len(made) > 1:
                raise RuntimeError("out of GPU memory while loading")

        def close(self) -> None:
            closes.append(made.index(self))

    def backend(model: str, index: int) -> SimBackend:
        made.append(Counted(latency_ms=5))
        if len(made) == 3:
            tried.set()
        return made[-1]

    runtime = EmbeddedRuntime(EmbeddedSettings(workers_per_model=1), backend)
    _refuse_results(runtime, math.inf)
    await runtime.start()
    await _submit(runtime)
    async with asyncio.timeout(20):
        await tried.wait()  # two replacements made; the watcher waits to try a third
    await runtime.close()
    assert sorted(closes) == list(range(len(made))), f"each backend closed once: {closes} of {len(made)}"


async def test_a_backend_that_raises_as_it_closes_does_not_end_the_slots_replacements(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A crashed worker's backend, and a replacement's that did not load, may raise as they close (a CUDA
    error outlives the call that caused it): the error is logged, and the slot is replaced all the same."""
    monkeypatch.setattr(embedded, "CRASH_BACKOFF_S", 0.01)
    made: list[SimBackend] = []

    class CloseFails(SimBackend):
        def load(self) -> None:
            if len(made) == 2:
                raise RuntimeError("out of GPU memory while loading")

        def close(self) -> None:
            if made.index(self) < 2:  # the third, serving at shutdown, closes cleanly
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def backend(model: str, index: int) -> SimBackend:
        made.append(CloseFails(latency_ms=5))
        return made[-1]

    runtime = EmbeddedRuntime(EmbeddedSettings(workers_per_model=1), backend)
    _refuse_results(runtime, 1)
    await runtime.start()
    answered = asyncio.Event()
    try:
        await runtime.store.listen_replies("gw", lambda state: answered.set())
        await _submit(runtime)
        async with asyncio.timeout(20):
            await answered.wait()
        assert len(made) == 3 and runtime.replaced == 1, "the crashed worker and a replacement that did not load"
        assert all((await runtime.ready()).values()), "the third backend serves"
        for closed in ("sim-worker-0", "sim-worker-0.1"):
            running = REGISTRY.get_sample_value("batchwire_worker_call_running_seconds", {"worker": closed})
            assert running is None, f"{closed}'s gauge, which holds its backend, is dropped at its close"
    finally:
        with caplog.at_level(logging.ERROR, logger=embedded.__name__):
            await runtime.close()
    closes = [r for r in caplog.records if r.name == embedded.__name__ and "did not close" in r.getMessage()]
    assert [r.exc_info is not None and str(r.exc_info[1]) for r in closes] == [
        "CUDA error: an illegal memory access was encountered"
    ] * 2, "each close error is logged with its traceback"


async def test_a_backend_that_raises_as_the_runtime_shuts_down_is_logged_and_the_rest_still_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One worker's close error (a CUDA error at its backend's close) is logged with its traceback; the
    other workers and the store are closed all the same, and the shutdown goes on."""
    made: list[SimBackend] = []
    closed: list[int] = []

    class CloseFails(SimBackend):
        def close(self) -> None:
            closed.append(made.index(self))
            if made.index(self) == 0:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def backend(model: str, index: int) -> SimBackend:
        made.append(CloseFails(latency_ms=5))
        return made[-1]

    runtime = EmbeddedRuntime(EmbeddedSettings(workers_per_model=2), backend)
    await runtime.start()
    with caplog.at_level(logging.ERROR, logger=embedded.__name__):
        await runtime.close()
    assert sorted(closed) == [0, 1], f"both backends closed: {closed}"
    assert not runtime.store.reachable(), "the store is closed after the worker whose backend raised"
    errors = [r for r in caplog.records if r.name == embedded.__name__ and "did not close" in r.getMessage()]
    assert [r.exc_info is not None and str(r.exc_info[1]) for r in errors] == [
        "CUDA error: an illegal memory access was encountered"
    ], "the close error is logged with its traceback"


async def test_a_replacement_shut_down_while_it_loads_logs_an_error_at_its_close(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A shutdown that cuts a replacement's load short closes the worker there, never its model under the
    load; an error of that close is logged, as every other worker's is, and does not stand in for the
    cancellation (its watcher would end with it, unseen)."""
    monkeypatch.setattr(embedded, "CRASH_BACKOFF_S", 0.01)
    made: list[SimBackend] = []
    loading, release = threading.Event(), threading.Event()
    closed_under_load: list[bool] = []

    class SlowLoad(SimBackend):
        def load(self) -> None:
            if made.index(self) == 1:
                loading.set()
                release.wait(30)

        def close(self) -> None:
            closed_under_load.append(loading.is_set() and not release.is_set())

    def backend(model: str, index: int) -> SimBackend:
        made.append(SlowLoad(latency_ms=5))
        return made[-1]

    close = Worker.close

    async def close_then_fail(worker: Worker, drain_timeout_s: float | None = None) -> None:
        await close(worker, drain_timeout_s)
        if made.index(worker.backend) == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(Worker, "close", close_then_fail)
    runtime = EmbeddedRuntime(EmbeddedSettings(workers_per_model=1), backend)
    _refuse_results(runtime, 1)
    await runtime.start()
    try:
        await _submit(runtime)
        assert await asyncio.to_thread(loading.wait, 20), "the crashed worker's replacement to start loading"
        with caplog.at_level(logging.ERROR, logger=embedded.__name__):
            await runtime.close()
    finally:
        release.set()
    assert True not in closed_under_load, "a model closed under its own load"
    closes = [r for r in caplog.records if r.name == embedded.__name__ and "did not close" in r.getMessage()]
    assert [r.exc_info is not None and str(r.exc_info[1]) for r in closes] == [
        "CUDA error: an illegal memory access was encountered"
    ], f"the replacement's close error is logged: {[r.getMessage() for r in caplog.records]}"


async def test_a_start_that_fails_on_one_worker_waits_for_the_others_so_close_closes_them() -> None:
    """One worker's start fails while another's is still coming up: ``start`` raises only once every worker's
    start ended, so the ``close`` that follows finds no worker still starting (its tasks left running after)."""
    runtime = EmbeddedRuntime(EmbeddedSettings(workers_per_model=2), lambda model, index: SimBackend(latency_ms=5))
    failing, slow = runtime.workers

    async def fail() -> None:
        raise RuntimeError("out of GPU memory while loading")

    joining = slow.consumer.start

    async def join_slowly(on_assigned: Any, on_revoked: Any) -> None:
        for _ in range(20):  # a group join takes round trips: this worker is still starting as the other fails
            await asyncio.sleep(0)
        await joining(on_assigned, on_revoked)

    failing.start = fail  # type: ignore[method-assign]
    slow.consumer.start = join_slowly  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="out of GPU memory"):
            await runtime.start()
        assert slow.state != "starting", "the other worker's start ended before start raised"
    finally:
        await runtime.close()
    assert asyncio.all_tasks() == {asyncio.current_task()}, "no task of the runtime left running"


async def test_no_replacement_starts_once_the_shutdown_began(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot whose backoff ends while the batcher closes is not refilled: a replacement would load its model
    during the shutdown, only to be closed."""
    backing_off, release = asyncio.Event(), asyncio.Event()

    async def back_off(worker_id: str, what: str, crashes: int) -> None:
        backing_off.set()
        await release.wait()

    monkeypatch.setattr(embedded, "_back_off", back_off)
    made: list[int] = []

    def backend(model: str, index: int) -> SimBackend:
        made.append(index)
        return SimBackend(latency_ms=5)

    runtime = EmbeddedRuntime(EmbeddedSettings(workers_per_model=1), backend)
    _refuse_results(runtime, 1)
    closing = runtime.batcher.close

    async def close_batcher() -> None:
        release.set()  # the backoff ends as the shutdown closes the batcher
        for _ in range(20):
            await asyncio.sleep(0)
        await closing()

    runtime.batcher.close = close_batcher  # type: ignore[method-assign]
    await runtime.start()
    try:
        await _submit(runtime)
        async with asyncio.timeout(20):
            await backing_off.wait()
    finally:
        await runtime.close()
    assert made == [0], "no replacement made once the shutdown began"


async def test_a_worker_whose_close_the_shutdown_interrupted_is_still_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shutdown cancels a slot's watcher while it closes the crashed worker: the shutdown's own close of
    that worker waits for the close begun, and its backend is closed, not left open."""

    async def back_off(worker_id: str, what: str, crashes: int) -> None:
        return None

    monkeypatch.setattr(embedded, "_back_off", back_off)
    closed: list[int] = []
    made: list[SimBackend] = []

    class Counted(SimBackend):
        def close(self) -> None:
            closed.append(made.index(self))

    def backend(model: str, index: int) -> SimBackend:
        made.append(Counted(latency_ms=5))
        return made[-1]

    runtime = EmbeddedRuntime(EmbeddedSettings(workers_per_model=1), backend)
    _refuse_results(runtime, 1)
    crashed = runtime.workers[0]
    leaving, release = asyncio.Event(), asyncio.Event()
    leave = crashed.consumer.close

    async def leave_slowly() -> None:  # a group leave that takes a round trip
        leaving.set()
        await release.wait()
        await leave()

    crashed.consumer.close = leave_slowly  # type: ignore[method-assign]
    await runtime.start()
    await _submit(runtime)
    async with asyncio.timeout(20):
        await leaving.wait()  # the watcher closes the crashed worker
    shutdown = asyncio.create_task(runtime.close())
    for _ in range(20):  # the shutdown cancels the watcher mid-close
        await asyncio.sleep(0)
    release.set()
    async with asyncio.timeout(20):
        await shutdown
    assert closed == [0], f"the crashed worker's backend is closed: {closed}"


async def test_a_model_whose_worker_is_down_leaves_the_process_ready_while_another_model_serves() -> None:
    """The process is unready only while no model has a live worker: one model's crashed worker (its
    replacement may fail to load for minutes) must not take the other models out of a load balancer, as
    over Kafka, where such a model is ``stalled`` and ``/readyz`` stays 200 while another model serves."""
    settings = EmbeddedSettings(shared=SharedSettings(models=("sim", "other")), workers_per_model=1)
    runtime = EmbeddedRuntime(settings, lambda model, index: SimBackend(latency_ms=5))
    _refuse_results(runtime, 1)
    await runtime.start()
    try:
        crashed = runtime.workers[0]
        assert crashed.settings.model == "sim"
        await _submit(runtime)
        async with asyncio.timeout(20):
            await crashed.failed.wait()
        assert runtime.workers[0] is crashed, "still in its backoff"
        ready = await runtime.ready()
        assert ready["workers"], f"the other model's worker serves, yet the process is unready: {ready}"
    finally:
        await runtime.close()


async def test_the_process_is_unready_while_no_model_has_a_live_worker() -> None:
    settings = EmbeddedSettings(shared=SharedSettings(models=("sim", "other")), workers_per_model=1)
    runtime = EmbeddedRuntime(settings, lambda model, index: SimBackend(latency_ms=5))
    _refuse_results(runtime, 2)
    await runtime.start()
    try:
        now = int(time.time() * 1000)
        for task_id, model in (("a", "sim"), ("b", "other")):
            await runtime.store.create(TaskState(task_id, TaskStatus.QUEUED, model, now, now, reply_to="gw"))
            await runtime.producer.send(InferenceRequest(task_id, model, "hello", now, now + 30_000, reply_to="gw"))
        crashed = list(runtime.workers)
        async with asyncio.timeout(20):
            for worker in crashed:
                await worker.failed.wait()
        assert runtime.workers == crashed, "both still in their backoff"
        assert not (await runtime.ready())["workers"], "no model has a live worker"
    finally:
        await runtime.close()
