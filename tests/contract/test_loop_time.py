"""``loop_time.timeout``: expires as ``asyncio.timeout`` does on a free loop, and leaves out the loop's stalls."""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractAsyncContextManager

import pytest

from transport import loop_time


async def test_it_expires_after_its_time_on_a_free_loop() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async with loop_time.timeout(0.2):
            await asyncio.Event().wait()
    took_s = time.monotonic() - started
    assert 0.2 <= took_s < 2.0, f"expired after {took_s:.2f} s"


async def answered_during_a_stall(bound: AbstractAsyncContextManager[object]) -> object:
    """What a wait under ``bound`` ends with when its answer comes 10 ms in, while the loop is blocked
    for 0.5 s (past the bound's 0.2 s): the stall is the fault under test."""
    answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def wait() -> str:
        async with bound:
            return await answer

    waiting = asyncio.ensure_future(wait())
    await asyncio.sleep(0)  # the wait begins
    asyncio.get_running_loop().call_later(0.01, answer.set_result, "up")
    time.sleep(0.5)  # noqa: ASYNC251  # the loop blocked
    return (await asyncio.gather(waiting, return_exceptions=True))[0]


async def test_asyncio_timeout_expires_in_the_turn_that_reads_an_answer_that_came_during_a_stall() -> None:
    outcome = await answered_during_a_stall(asyncio.timeout(0.2))
    assert isinstance(outcome, TimeoutError), f"asyncio.timeout read the answer: {outcome!r}"


async def test_an_answer_that_came_while_the_loop_was_blocked_is_read() -> None:
    outcome = await answered_during_a_stall(loop_time.timeout(0.2))
    assert outcome == "up", f"the loop's stall counted against the wait: {outcome!r}"
