"""Calls that arrive while one is on its way go together as the next one: one round trip for many.

redis-py spends CPU on each command whatever it carries (connection checkout, retry wrapper,
encode, parse), and a gateway makes one ``create`` per request. Coalesced, a burst shares one script
call. At light load a call goes alone, one task hop later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from transport.cancelling import cancel_and_wait

A = TypeVar("A")
R = TypeVar("R")


class Coalescer(Generic[A, R]):
    """``await coalescer(item)`` -> ``flush(items)[i]``; one flush at a time, of everything queued."""

    def __init__(self, flush: Callable[[list[A]], Awaitable[Sequence[R]]], *, max_items: int = 256) -> None:
        self._flush = flush
        self.max_items = max_items
        self._queued: list[tuple[A, asyncio.Future[R]]] = []
        self._task: asyncio.Task[None] | None = None

    async def __call__(self, item: A) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queued.append((item, future))
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="coalesced-calls")
        return await future

    async def close(self, error: Exception) -> None:
        """Stops the flushing task; calls still waiting (or in the flush it cut short) fail with ``error``."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        waiting, self._queued = self._queued, []
        for _, future in waiting:
            if not future.done():
                future.set_exception(error)

    async def _run(self) -> None:
        try:
            while self._queued:
                batch, self._queued = self._queued[: self.max_items], self._queued[self.max_items :]
                try:
                    results = await self._flush([item for item, _ in batch])
                except Exception as err:  # every caller of this batch gets it (as if it had called alone)
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(err)
                    continue
                except BaseException:  # cancelled by close(): it fails the callers still waiting
                    self._queued[:0] = batch
                    raise
                for (_, future), result in zip(batch, results, strict=True):
                    if not future.done():
                        future.set_result(result)
        finally:
            if self._task is asyncio.current_task():
                self._task = None
