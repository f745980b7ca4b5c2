"""A part's background loop: runs until closed, is cancelled and awaited, and never dies silently."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.eventually import eventually
from transport.background_loop import BackgroundLoop


async def idle() -> None:
    await asyncio.Event().wait()


async def test_close_cancels_the_loop_and_waits_for_it_to_end() -> None:
    entered, cleaned_up = asyncio.Event(), asyncio.Event()

    async def forever() -> None:
        entered.set()
        try:
            await asyncio.Event().wait()
        finally:
            cleaned_up.set()

    loop = BackgroundLoop("watch")
    loop.start(forever())
    await asyncio.wait_for(entered.wait(), 5)
    assert loop.alive and loop.started
    await loop.close()
    assert cleaned_up.is_set(), "close returned before the loop's own clean-up ran"
    assert not loop.alive and not loop.started
    await loop.close()  # a second close does nothing


async def test_a_second_start_is_refused_and_its_coroutine_closed() -> None:
    loop = BackgroundLoop("watch")
    loop.start(idle())
    spare = asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="watch started twice"):
        loop.start(spare)
    assert spare.cr_frame is None, "the refused coroutine was left unclosed (a 'never awaited' warning)"
    await loop.close()


async def test_a_loop_that_dies_is_logged_and_no_longer_alive(caplog: pytest.LogCaptureFixture) -> None:
    async def broken() -> None:
        raise RuntimeError("bug in the loop")

    loop = BackgroundLoop("watch")
    loop.start(broken())
    await eventually(lambda: not loop.alive, "the broken loop to end")
    assert loop.started
    assert "background task watch died" in caplog.text and "bug in the loop" in caplog.text
    await loop.close()  # awaiting a failed loop raises nothing


async def test_a_closed_loop_can_start_again() -> None:
    loop = BackgroundLoop("watch")
    loop.start(idle())
    await loop.close()
    loop.start(idle())
    assert loop.alive
    await loop.close()


async def test_close_ends_a_loop_that_swallowed_its_cancellation() -> None:
    """A library below can lose a cancellation (redis-py, cancelled mid-command): the loop goes on to
    its next wait. ``close`` cancels it again there rather than waiting for ever."""
    entered = asyncio.Event()
    swallowed = 0

    async def loop_over_a_lossy_call() -> None:
        nonlocal swallowed
        while True:
            entered.set()
            try:
                await asyncio.Event().wait()  # a command in flight
            except asyncio.CancelledError:
                swallowed += 1  # what the library does: the loop carries on
            await asyncio.sleep(3600)  # the loop's own wait: a second cancellation ends it here

    loop = BackgroundLoop("watch")
    loop.start(loop_over_a_lossy_call())
    await asyncio.wait_for(entered.wait(), 5)
    await asyncio.wait_for(loop.close(), 5)
    assert swallowed == 1 and not loop.alive
