"""The Gateway without HTTP: register-then-publish, lost replies, shutdown, and event dedupe."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any

import pytest

from gateway.answers.waiters import ReplyWaiters
from gateway.errors import InvalidTaskId, NotReady, TaskNotFound, ValidationFailed
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from schemas.records import InferenceRequest, TaskState, TaskStatus
from tests.support.eventually import eventually
from tests.support.fake_clock import FixedClock
from tests.support.gateway_rig import FakeWorker, now_ms, statuses
from transport.memory.requests import MemoryRequestBus
from transport.memory.store import MemoryTaskStore
from transport.ports import TransportError
from transport.routing import Partitioner


class InstantProducer:
    """Answers inside ``send``: the reply lands before ``submit`` even awaits its future."""

    def __init__(self, store: MemoryTaskStore) -> None:
        self.store = store
        self.sent: list[InferenceRequest] = []

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def ready(self) -> bool:
        return True

    def reachable(self) -> bool:
        return True

    async def send(self, request: InferenceRequest) -> None:
        self.sent.append(request)
        await self.store.apply(
            [
                TaskState(
                    request.task_id,
                    TaskStatus.COMPLETED,
                    request.model,
                    now_ms(),
                    request.enqueued_at_ms,
                    output="instant",
                    reply_to=request.reply_to,
                )
            ]
        )


def _settings(**overrides: Any) -> GatewaySettings:
    return GatewaySettings(**{"models": ("sim",), **overrides})


async def test_reply_published_during_send_still_reaches_the_caller() -> None:
    store = MemoryTaskStore()
    producer = InstantProducer(store)
    gateway = Gateway(_settings(), producer, store, FixedClock())
    await gateway.start()
    try:
        answer = await asyncio.wait_for(gateway.submit("abc", None, 5000, True), 10)
    finally:
        await gateway.close()
    assert answer.output == "instant", answer
    assert gateway.waiting == 0, "the waiter must be removed once answered"


async def test_request_carries_clock_times_deadline_and_reply_address() -> None:
    store = MemoryTaskStore()
    producer = InstantProducer(store)
    clock = FixedClock()
    gateway = Gateway(_settings(gateway_id="gw-test"), producer, store, clock)
    await gateway.start()
    try:
        await gateway.submit("abc", "sim", 1234, True)
        await gateway.submit("abc", "sim", 1234, False)
    finally:
        await gateway.close()
    sync, queued = producer.sent
    assert sync.enqueued_at_ms == clock.wall
    assert clock.wall + 1234 - 500 < sync.deadline_ms <= clock.wall + 1234, "what is left of the timeout when sent"
    assert sync.reply_to == "gw-test"
    assert queued.reply_to is None, "an asynchronous request must not ask for a reply"
    assert sync.task_id != queued.task_id
    assert len(sync.task_id) >= 22, "task ids must be unguessable (128 random bits)"


async def test_lost_reply_is_recovered_from_the_store() -> None:
    store = MemoryTaskStore()
    bus = MemoryRequestBus(Partitioner(("sim",), 2))
    gateway = Gateway(_settings(reply_recheck_s=0.05), bus.producer(), store)
    worker = FakeWorker(bus, store, reply=False)
    await gateway.start()
    await worker.start()
    try:
        answer = await asyncio.wait_for(gateway.submit("lost", None, 20_000, True), 10)
    finally:
        await worker.close()
        await gateway.close()
    assert answer.output == "tsol"


async def test_close_wakes_waiting_callers_with_not_ready() -> None:
    store = MemoryTaskStore()
    bus = MemoryRequestBus(Partitioner(("sim",), 2))
    gateway = Gateway(_settings(), bus.producer(), store)
    await gateway.start()
    caller = asyncio.create_task(gateway.submit("nobody answers", None, 30_000, True))
    await eventually(lambda: gateway.waiting == 1, "the caller to wait")
    await gateway.close()
    with pytest.raises(NotReady):
        await asyncio.wait_for(caller, 10)
    assert gateway.waiting == 0
    assert gateway.ready()["gateway"] is False
    with pytest.raises(NotReady):
        await gateway.submit("after close", None, None, False)


async def test_start_twice_is_refused() -> None:
    store = MemoryTaskStore()
    gateway = Gateway(_settings(), InstantProducer(store), store)
    await gateway.start()
    try:
        with pytest.raises(RuntimeError, match="twice"):
            await gateway.start()
    finally:
        await gateway.close()


class BrokenSweepStore(MemoryTaskStore):
    async def get_many(self, task_ids: Collection[str]) -> dict[str, TaskState]:
        raise RuntimeError("bug in get_many")


async def test_dead_sweeper_is_logged_and_turns_readiness_red(caplog: pytest.LogCaptureFixture) -> None:
    store = BrokenSweepStore()
    bus = MemoryRequestBus(Partitioner(("sim",), 2))
    gateway = Gateway(_settings(reply_recheck_s=0.02), bus.producer(), store)
    await gateway.start()
    caller = asyncio.create_task(gateway.submit("x", None, 30_000, True))
    try:
        assert gateway.ready()["gateway"] is True
        await eventually(lambda: "reply-sweeper" in caplog.text, "the sweeper's death to be logged")
        assert gateway.ready()["gateway"] is False
    finally:
        await gateway.close()
    with pytest.raises(NotReady):
        await asyncio.wait_for(caller, 10)
    assert "bug in get_many" in caplog.text


async def test_result_refuses_bad_ids_unknown_ids_and_waits_that_are_not_a_time() -> None:
    store = MemoryTaskStore()
    gateway = Gateway(_settings(max_poll_wait_s=5.0), InstantProducer(store), store)
    with pytest.raises(InvalidTaskId):
        await gateway.result("no:colons")
    with pytest.raises(TaskNotFound):
        await gateway.result("unknown-id", 0.5)
    for wait_s in (-1.0, float("nan")):
        with pytest.raises(ValidationFailed, match="send seconds, 0 or more"):
            await gateway.result("unknown-id", wait_s)
    assert gateway.watchers == 0


async def test_a_wait_past_the_longest_waits_the_longest_and_answers_the_state_then() -> None:
    """As long-polls do: a client need not know the deployment's setting, and polls again."""
    store = MemoryTaskStore()
    bus = MemoryRequestBus(Partitioner(("sim",), 2))
    gateway = Gateway(_settings(max_poll_wait_s=0.2), bus.producer(), store)
    await gateway.start()
    try:
        queued = await gateway.submit("nobody computes it", None, 30_000, False)
        state = await asyncio.wait_for(gateway.result(queued.task_id, 1e9), 10)
    finally:
        await gateway.close()
    assert state.status is TaskStatus.QUEUED, state
    assert gateway.watchers == 0


class ScriptedStore(MemoryTaskStore):
    """A store whose change feed is a script: duplicates, regressions, or nothing at all."""

    def __init__(self, script: Sequence[TaskState]) -> None:
        super().__init__()
        self.script = script

    @asynccontextmanager
    async def watch(self, task_id: str) -> AsyncIterator[AsyncIterator[TaskState]]:
        async def feed() -> AsyncIterator[TaskState]:
            for state in self.script:
                yield state
            await asyncio.Event().wait()  # then silence, like a subscription that lost messages

        yield feed()


def _state(status: TaskStatus, **extra: Any) -> TaskState:
    return TaskState("t1", status, "sim", now_ms(), now_ms(), **extra)


async def test_events_never_repeat_or_go_back() -> None:
    script = [_state(s) for s in (TaskStatus.QUEUED, TaskStatus.RUNNING, TaskStatus.BATCHED, TaskStatus.RUNNING)]
    script.append(_state(TaskStatus.COMPLETED, output="x"))
    script.append(_state(TaskStatus.FAILED))
    store = ScriptedStore(script)
    await store.create(_state(TaskStatus.QUEUED))
    gateway = Gateway(_settings(), InstantProducer(store), store)
    async with aclosing(gateway.events("t1")) as events:
        seen = [state async for state in events]
    assert statuses(seen) == ["queued", "running", "completed"]
    assert gateway.watchers == 0


class BlipStore(ScriptedStore):
    """A scripted store whose second read (the stream's first recheck) fails once, as a slow read or a
    Redis blip does."""

    def __init__(self) -> None:
        super().__init__([])
        self.reads = 0

    async def get(self, task_id: str) -> TaskState | None:
        self.reads += 1
        if self.reads == 2:
            raise TransportError("one slow read timed out")
        return await super().get(task_id)


@pytest.mark.parametrize("blip", [False, True], ids=["recheck", "a failed recheck, then the next"])
async def test_events_recheck_the_store_when_changes_are_lost(blip: bool) -> None:
    """The re-read is a backstop for lost change messages: one that fails must not end a stream whose
    subscription still works."""
    store = BlipStore() if blip else ScriptedStore([])
    await store.create(_state(TaskStatus.QUEUED))
    gateway = Gateway(_settings(stream_recheck_s=0.02), InstantProducer(store), store)
    seen: list[TaskState] = []

    async def consume() -> None:
        async with aclosing(gateway.events("t1")) as events:
            async for state in events:
                seen.append(state)
                if state.status is TaskStatus.QUEUED:
                    await store.apply([_state(TaskStatus.COMPLETED, output="found")])

    await asyncio.wait_for(consume(), 10)
    assert statuses(seen) == ["queued", "completed"]
    assert gateway.watchers == 0


async def test_events_of_an_unknown_task_raise_not_found() -> None:
    store = MemoryTaskStore()
    gateway = Gateway(_settings(), InstantProducer(store), store)
    with pytest.raises(TaskNotFound):
        await anext(gateway.events("missing"))
    assert gateway.watchers == 0


async def test_sweeper_transport_errors_are_retried_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    class FlakyStore(MemoryTaskStore):
        calls = 0

        async def get_many(self, task_ids: Collection[str]) -> dict[str, TaskState]:
            FlakyStore.calls += 1
            if FlakyStore.calls == 1:
                raise TransportError("redis reconnecting")
            return await super().get_many(task_ids)

    store = FlakyStore()
    bus = MemoryRequestBus(Partitioner(("sim",), 2))
    gateway = Gateway(_settings(reply_recheck_s=0.02), bus.producer(), store)
    worker = FakeWorker(bus, store, reply=False)
    await gateway.start()
    await worker.start()
    caplog.set_level(logging.WARNING)
    try:
        answer = await asyncio.wait_for(gateway.submit("flaky", None, 20_000, True), 10)
        assert gateway.ready()["gateway"] is True
    finally:
        await worker.close()
        await gateway.close()
    assert answer.output == "ykalf"
    assert FlakyStore.calls >= 2
    assert "retrying" in caplog.text


async def test_late_waiters_are_looked_up_with_a_doubling_delay() -> None:
    waiters = ReplyWaiters(first_check_s=1.0)
    waiters.register("a", now=0.0)
    looked_up_at = [t / 2 for t in range(0, 60) if waiters.due(t / 2, limit=10)]
    assert looked_up_at == [1.0, 3.0, 7.0, 15.0, 23.0], "delays 1, 2, 4, 8, then capped at 8"
