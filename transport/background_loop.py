"""One long-lived background coroutine that a part owns: started once, cancelled and awaited at close.

A part that watches or refreshes something (Redis's memory, the queue's lag, lost replies) runs a
loop that should never end on its own. If it does (a bug), the failure is logged and ``alive`` turns
False, which the part's health check reports, rather than the loop vanishing with its exception.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from transport.cancelling import cancel_and_wait

log = logging.getLogger(__name__)


class BackgroundLoop:
    """Holds at most one task; ``start`` runs it, ``close`` cancels it and waits for it to end."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._task: asyncio.Task[None] | None = None

    @property
    def started(self) -> bool:
        """Started and not closed since (whether or not it still runs)."""
        return self._task is not None

    @property
    def alive(self) -> bool:
        """Started, and still running."""
        return self._task is not None and not self._task.done()

    def start(self, work: Coroutine[Any, Any, None]) -> None:
        """Runs ``work`` in the background; ``RuntimeError`` if started already (``work`` is closed)."""
        if self._task is not None:
            work.close()
            raise RuntimeError(f"{self.name} started twice")
        self._task = asyncio.create_task(work, name=self.name)
        self._task.add_done_callback(_log_end)

    async def close(self) -> None:
        """Cancels the task and waits for it; does nothing if not started. It can be started again."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)  # its failure, if any, was logged by _log_end


def _log_end(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s died; its part reports not ready", task.get_name(), exc_info=task.exception())
