"""Following one task's changes: forward only, with periodic store re-reads for lost messages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from schemas.records import TaskState
from transport.cancelling import cancel_and_wait

Read = Callable[[str], Awaitable[TaskState | None]]
"""The task's state as the store holds it now (None: no such task)."""


async def follow(
    read: Read,
    changes: AsyncIterator[TaskState],
    last: TaskState,
    deadline: float,
    recheck_s: float,
    due_s: Callable[[TaskState], float | None] | None = None,
) -> AsyncGenerator[TaskState, None]:
    """Each state after ``last`` of a higher rank than the one before, until a terminal one.

    ``changes`` is a store watch entered before ``last`` was read. Every ``recheck_s`` without a
    change the task is ``read`` again, since a change message can be lost (a PubSub reconnect); and
    once more when ``due_s`` of the last state (seconds) runs out, for a ``read`` that ends a task
    no other role may end then (``TaskReads``: one past its deadline). Ends at ``deadline``
    (event-loop time) or when the store ends the subscription.
    """
    loop = asyncio.get_running_loop()
    # A timeout that cancelled ``anext`` would end the store's iterator, so the next change is
    # awaited in a task of its own, which outlives the recheck timeouts and is cancelled on exit.
    pending: asyncio.Future[TaskState] | None = None
    try:
        while not last.status.terminal:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            wait_s = min(remaining, recheck_s)
            if due_s is not None and (due := due_s(last)) is not None and due > 0:
                wait_s = min(wait_s, due)
            if pending is None:
                pending = asyncio.ensure_future(anext(changes))
            done, _ = await asyncio.wait({pending}, timeout=wait_s)
            if done:
                change: TaskState | None = pending.result()
                pending = None
            else:
                change = await read(last.task_id)
            if change is not None and change.status.rank > last.status.rank:
                last = change
                yield last
    except StopAsyncIteration:
        return  # the store ended the subscription (it is closing): the client reconnects
    finally:
        if pending is not None:
            await cancel_and_wait(pending)
