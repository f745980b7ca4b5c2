"""The re-check of held callers when the task store's change feed comes back, over the memory store."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection

import pytest

from gateway.answers.reconnect_recheck import ReconnectRecheck
from gateway.answers.waiters import ReplyWaiters
from schemas.records import TaskState, TaskStatus
from tests.support.gateway_rig import now_ms
from transport.memory.store import MemoryTaskStore
from transport.ports import TransportError


class FlakyFeedStore(MemoryTaskStore):
    """The memory store whose change feed can drop and return, as Redis's does during a failover."""

    def __init__(self) -> None:
        super().__init__()
        self.feed_up = True
        self._callbacks: list[Callable[[], None]] = []

    def reachable(self) -> bool:
        return self.feed_up and super().reachable()

    def on_feed_return(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def feed_returns(self) -> None:
        self.feed_up = True
        for callback in self._callbacks:
            callback()


def _state(task_id: str, status: TaskStatus) -> TaskState:
    return TaskState(task_id, status, "sim", now_ms(), now_ms(), output="ok" if status.terminal else None)


async def test_a_reply_lost_while_the_feed_was_down_reaches_its_caller_when_the_feed_returns() -> None:
    store = FlakyFeedStore()
    waiters = ReplyWaiters(first_check_s=1000.0)  # the sweep never runs here
    recheck = ReconnectRecheck(store, waiters)
    recheck.start()
    try:
        ended = waiters.register("ended", 0.0)
        running = waiters.register("running", 0.0)
        await store.create(_state("ended", TaskStatus.QUEUED))
        await store.create(_state("running", TaskStatus.QUEUED))
        store.feed_up = False
        # Stored without a reply address: the reply is lost, as one published while the feed was down.
        await store.apply([_state("ended", TaskStatus.COMPLETED), _state("running", TaskStatus.RUNNING)])
        assert not ended.done(), "nothing is re-read while the feed is down"
        assert recheck.rechecks == 0
        store.feed_returns()
        answer = await asyncio.wait_for(ended, 2.0)
        assert answer.status is TaskStatus.COMPLETED and answer.output == "ok", answer
        assert not running.done(), "a task still running leaves its caller waiting"
        assert recheck.rechecks == 1, f"one re-check per return of the feed, got {recheck.rechecks}"
        assert recheck.alive
    finally:
        await recheck.close()
    assert not recheck.alive


async def test_held_lists_only_callers_still_waiting() -> None:
    waiters = ReplyWaiters(first_check_s=1.0)
    waiters.register("a", 0.0)
    waiters.register("b", 0.0)
    waiters.resolve(_state("b", TaskStatus.COMPLETED))
    assert waiters.held() == ["a"]


class FailingReadStore(FlakyFeedStore):
    """Its reads fail, as they do when the feed drops again right after it returned."""

    async def get_many(self, task_ids: Collection[str]) -> dict[str, TaskState]:
        raise TransportError("connection lost again")


async def test_a_recheck_whose_read_failed_says_how_many_callers_it_read(caplog: pytest.LogCaptureFixture) -> None:
    """An operator reading an outage's logs must not be told that callers were re-read when none were:
    they wait for the next return of the feed, or for the lost-reply sweep."""
    store = FailingReadStore()
    waiters = ReplyWaiters(first_check_s=1000.0)
    waiters.register("a", 0.0)
    waiters.register("b", 0.0)
    recheck = ReconnectRecheck(store, waiters)
    with caplog.at_level(logging.WARNING, logger="gateway.answers.reconnect_recheck"):
        answered = await recheck.recheck()
    assert answered == 0
    summary = [r.getMessage() for r in caplog.records if "reachable again" in r.getMessage()]
    assert summary == [
        "task store reachable again: re-read 0 of 2 held caller(s), 0 had an answer whose reply was lost"
    ], summary
