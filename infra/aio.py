"""Run a coroutine to completion from blocking code, whether or not a loop is running here."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def run_blocking(make_coro: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """`asyncio.run(make_coro())`, moved to a helper thread when this thread runs a loop.

    The blocking service API (`LocalStack.start()` and friends) is meant for threads, but a
    test that calls it straight from a coroutine should block, not crash with "asyncio.run()
    cannot be called from a running event loop".
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coro())
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="infra-run-blocking") as pool:
        return pool.submit(lambda: asyncio.run(make_coro())).result()
