"""Waiting for a condition: poll it until it holds, or fail naming what was awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(
    check: Callable[[], object], what: str, *, timeout_s: float = 10.0, interval_s: float = 0.005
) -> None:
    """Polls ``check`` on the event loop until it holds; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(interval_s)


def eventually_sync(
    check: Callable[[], object], what: str, *, timeout_s: float = 10.0, interval_s: float = 0.05
) -> None:
    """Polls ``check`` with a blocking sleep (process-level tests); fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)
