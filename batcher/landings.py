"""The batches on their way to the bus: the dispatcher's landing tasks, owned and awaited here.

A sealed batch lands in a task of its own (``Dispatcher._land``) so that the dispatcher need not
wait for the bus's acknowledgement before the next worker's credit. A rebalance or a close waits for
every landing (``landed``); a credit claimed only to be kept for a future request waits for them too
(``settled``), so that its round trip does not compete with the hops of the batch just sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class Landings:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, landing: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(landing, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def landed(self) -> None:
        """Returns once every batch started so far is on the bus or given back (landings started
        meanwhile included)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def settled(self, wake: asyncio.Event) -> None:
        """Returns once no batch is landing, or as soon as ``wake`` is set."""
        if not self._tasks or wake.is_set():
            return
        woken = asyncio.create_task(wake.wait())
        try:
            while self._tasks and not woken.done():
                await asyncio.wait({woken, *self._tasks}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            await asyncio.gather(woken, return_exceptions=True)
