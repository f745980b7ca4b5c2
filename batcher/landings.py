"""The batches on their way to the bus: the dispatcher's landing tasks, owned and awaited here.

A sealed batch lands in a task of its own (``Dispatcher._land``) so that the dispatcher need not
wait for the bus's acknowledgement before the next worker's credit. A rebalance or a close waits for
every landing (``landed``). How many land at once needs no cap of its own: each holds a credit, and
a worker offers its next credit only after a batch reached it.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict


class Landings:
    def __init__(self) -> None:
        self._tasks: defaultdict[str, set[asyncio.Task[None]]] = defaultdict(set)

    def add(self, key: str, task: asyncio.Task[None]) -> None:
        tasks = self._tasks[key]
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def under_way(self, key: str | None = None) -> int:
        """How many batches (of ``key``, or of every key) are on their way."""
        if key is not None:
            return len(self._tasks[key])
        return sum(len(tasks) for tasks in self._tasks.values())

    async def landed(self) -> None:
        """Returns once every batch started so far is on the bus or given back (landings started
        meanwhile included)."""
        while self.under_way():
            await asyncio.gather(*self._all(), return_exceptions=True)

    def _all(self) -> set[asyncio.Task[None]]:
        return set[asyncio.Task[None]]().union(*self._tasks.values())
