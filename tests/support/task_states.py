"""Task states for store tests: a state built with defaults, and the next one a watcher sees."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from schemas.records import TaskState, TaskStatus

EVENT_TIMEOUT_S = 5.0


def state(task_id: str, status: TaskStatus, **fields: object) -> TaskState:
    """A state of model ``alpha`` updated now; ``fields`` override the rest."""
    base: dict[str, object] = {"model": "alpha", "updated_at_ms": int(time.time() * 1000), "enqueued_at_ms": 1}
    base.update(fields)
    return TaskState(task_id, status, **base)  # type: ignore[arg-type]


async def next_state(events: AsyncIterator[TaskState]) -> TaskState:
    """The next state ``events`` yields, failing after ``EVENT_TIMEOUT_S``."""
    return await asyncio.wait_for(anext(events), EVENT_TIMEOUT_S)
