"""The role supervisor: a crashed loop ends the process non-zero, and a stuck shutdown cannot hang it."""

from __future__ import annotations

import asyncio
import time

from batchwire.supervise import supervise


async def test_a_crashed_loop_makes_the_process_exit_non_zero() -> None:
    failed = asyncio.Event()
    closed: list[bool] = []

    async def start() -> None:
        asyncio.get_running_loop().call_later(0.05, failed.set)

    async def close() -> None:
        closed.append(True)

    assert await supervise(start, close, failed, failure_code=lambda: 75) == 75
    assert closed == [True], "the services are closed before exiting"


async def test_a_shutdown_that_hangs_is_cut_short() -> None:
    failed = asyncio.Event()

    async def start() -> None:
        failed.set()

    async def close() -> None:
        await asyncio.Event().wait()  # a broker that never answers

    started = time.monotonic()
    assert await supervise(start, close, failed, close_timeout_s=0.2) == 1
    assert time.monotonic() - started < 2
