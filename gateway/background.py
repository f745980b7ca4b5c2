"""Tasks a gateway part starts and does not await itself, owned by one ``TaskGroup``.

A request handler that hands work off (a shared computation, a write to finish once the store is
back) must not outlive the gateway: ``close`` cancels every such task and waits for it, cancelling
again a task that lost its cancellation in a library below (``transport.cancelling``): the group
itself cancels its tasks once only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

from transport.cancelling import RECANCEL_S


class Background:
    """One ``TaskGroup``, held open by a task of its own from ``start`` to ``close``."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._group: asyncio.TaskGroup | None = None
        self._host: asyncio.Task[None] | None = None
        self._started = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def alive(self) -> bool:
        """Whether the group is held (a crash of one of its tasks ends it: /readyz turns red)."""
        return self._host is not None and not self._host.done()

    async def start(self) -> None:
        self._host = asyncio.create_task(self._hold(), name=self._name)
        await self._started.wait()

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Runs ``work`` in the group; ``RuntimeError`` (the coroutine closed, for its caller to run it
        itself) before ``start``, after ``close``, and while the group shuts down after a task crashed."""
        if self._group is None:
            work.close()
            raise RuntimeError(f"{self._name}: a task spawned before start() or after close()")
        try:
            task = self._group.create_task(work, name=name)
        except RuntimeError:
            work.close()
            raise
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        """Cancels every task in the group and waits for them."""
        host, self._host = self._host, None
        if host is not None:
            host.cancel()
            while not host.done():
                await asyncio.wait({host}, timeout=RECANCEL_S)
                for task in self._tasks:
                    task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await host
        self._group = None

    async def _hold(self) -> None:
        async with asyncio.TaskGroup() as group:
            self._group = group
            self._started.set()
            await asyncio.Future()  # until close cancels it; the group then cancels and awaits its tasks
