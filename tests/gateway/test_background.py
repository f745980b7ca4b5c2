"""A gateway part's background tasks end with its close, even one whose first cancellation was lost
(as a library below can lose it: ``transport.cancelling``)."""

from __future__ import annotations

import asyncio

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
