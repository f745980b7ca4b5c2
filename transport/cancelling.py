"""Cancelling a task and waiting for it to end, when a library below may lose the cancellation.

A cancellation can be lost below us: on Python 3.11 ``asyncio.wait_for`` returns the result of an
inner task that finished as the cancellation came, and redis-py sends every command under it, so a
loop whose Redis command was in flight when it was cancelled can go on as if nothing happened. Its
owner, waiting for it to end, would wait for ever (a gateway that could not bind its port hung in
shutdown this way). Cancelled again, such a task ends at its next wait. batchwire's own code waits
under ``asyncio.timeout`` instead, which keeps the cancellation (ruff bans ``asyncio.wait_for``), and
every owner that stops a loop doing I/O stops it with ``cancel_and_wait``.
"""

from __future__ import annotations

import asyncio
from typing import Any

RECANCEL_S = 0.05
"""How long to wait for a cancelled task before cancelling it again."""


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancels ``task`` and waits for it to end, cancelling it again every ``RECANCEL_S`` while it runs
    on; its exception, if it failed instead, is retrieved and dropped (its owner logs or reports it)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)
    if not task.cancelled():
        task.exception()
