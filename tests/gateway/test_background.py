"""A gateway part's background tasks end with its close, even one whose first cancellation was lost
(as a library below can lose it: ``transport.cancelling``)."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from gateway.background import Background


async def test_close_ends_a_task_that_lost_its_first_cancellation() -> None:
    background = Background("test")
    await background.start()
    started, lost = asyncio.Event(), asyncio.Event()

    async def stubborn() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            lost.set()  # swallowed, as a lost cancellation is
        await asyncio.Event().wait()  # runs on until cancelled again

    background.spawn(stubborn(), "stubborn")
    await started.wait()
    async with asyncio.timeout(5):
        await background.close()
    assert lost.is_set(), "the first cancellation reached the task and was lost there"
    assert not background.alive


async def test_a_spawn_while_the_group_shuts_down_after_a_crash_is_refused_and_its_work_closed() -> None:
    """A task that crashed has the group cancel the others: until they end, the group takes no task, and
    the work handed to it must be closed (never awaited, Python warns) for its caller to run it itself."""
    background = Background("test")
    await background.start()
    cancelled, release = asyncio.Event(), asyncio.Event()

    async def slow_to_end() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            await release.wait()  # ends only when let go: the group is shutting down meanwhile
            raise

    async def crash() -> None:
        raise ValueError("a bug")

    async def work() -> None:
        raise AssertionError("never run")

    background.spawn(slow_to_end(), "slow")
    background.spawn(crash(), "crash")
    await cancelled.wait()
    handed = work()
    with pytest.raises(RuntimeError):
        background.spawn(handed, "late")
    assert inspect.getcoroutinestate(handed) == inspect.CORO_CLOSED
    release.set()
    with pytest.raises(ExceptionGroup):
        await background.close()
