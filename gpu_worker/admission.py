"""Admission: a batch's tasks move to ``running`` before the backend sees them.

A task whose move is refused because it already ended (cancelled, expired, done by an earlier
delivery) is not run at all. A synchronous task that no one stored moves by that check alone: only
its caller waits for it, and for its end (``TaskStore.apply``). Each Kafka delivery of a batch is
counted first, so a redelivered batch is known and runs carefully (``careful``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from gpu_worker.calls import Failure
from gpu_worker.states import task_state
from schemas.records import Batch, BatchItem, TaskState, TaskStatus, shorter_than_call
from telemetry import logs
from transport.deliveries import DeliveryLog
from transport.ports import TaskStore
from transport.retry import Retrying

log = logging.getLogger(__name__)


EXPIRED = Failure(
    "deadline_exceeded",
    "the request's deadline would pass before the GPU could finish it (the model's queue was long): "
    "retry later, or send a longer timeout_ms",
)


def expired_error(item: BatchItem, call_ms: float) -> Failure:
    """Why ``item`` expired: a timeout shorter than one call could never be met, whatever the queue. The
    item does not say whether its caller set ``timeout_ms`` or took the gateway's default, which may be the
    short one: the advice names both. Nor does it carry that timeout, only what was left of it when the
    gateway sent the request (admission's waits spent): the message names that figure as such."""
    left_ms = item.deadline_ms - item.enqueued_at_ms
    if call_ms <= 0 or left_ms >= call_ms:
        return EXPIRED
    return Failure(
        "deadline_exceeded",
        f"what was left of the request's timeout when the gateway sent it ({left_ms} ms; the timeout is its "
        f"timeout_ms, else the gateway's --default-timeout-ms) is {shorter_than_call(call_ms)}, so no answer "
        f"could be in time: send a timeout_ms above {call_ms:.0f}, or have the operator raise --default-timeout-ms",
    )


class Admission:
    """Counts a batch's deliveries and moves its live tasks to ``running``, dropping those that ended."""

    def __init__(
        self, worker_id: str, store: TaskStore, deliveries: DeliveryLog, retry: Retrying, *, keep_ended: bool
    ) -> None:
        self.worker_id = worker_id
        self.store = store
        self.deliveries = deliveries
        self.retry = retry
        self.keep_ended = keep_ended
        """Keep the states of tasks that ended before their batch ran, to store them again with its
        results (with Redis replicas: they may be on a lost primary alone)."""
        self._ended_before: dict[str, list[TaskState]] = {}

    def expire_late(
        self, batch: Batch, ends_by_ms: int, call_ms: float = 0.0, items: Sequence[BatchItem] | None = None
    ) -> tuple[list[TaskState], list[BatchItem]]:
        """(The ``expired`` states of the items (``items``, else the batch's) whose deadline a call
        ending at ``ends_by_ms`` would miss, the live items.) Such a call computes an answer nobody
        may receive: the GPU's time goes to items that can still be answered. ``call_ms``: the
        model's expected call."""
        items = batch.items if items is None else items
        late = [
            task_state(self.worker_id, batch, item, TaskStatus.EXPIRED, error=expired_error(item, call_ms))
            for item in items
            if item.deadline_ms <= ends_by_ms
        ]
        return late, [item for item in items if item.deadline_ms > ends_by_ms]

    async def count_and_admit(self, batch: Batch, live: list[BatchItem], receipt: str) -> tuple[int, list[BatchItem]]:
        """Counts this delivery (``receipt``: this worker's receipt of it, the same on every retry, see
        ``DeliveryLog.begin``) and admits the live items: (deliveries so far, the items to run). The
        two wait one round trip together, not two; one that fails stops the other (a ``TaskGroup``:
        its errors come grouped)."""

        async def count() -> int:
            return await self.retry("counting a delivery", lambda: self.deliveries.begin(batch.batch_id, receipt))

        async with asyncio.TaskGroup() as group:
            counting = group.create_task(count())
            admitting = group.create_task(self.admit(batch, live))
        return counting.result(), admitting.result()

    async def admit(self, batch: Batch, live: list[BatchItem]) -> list[BatchItem]:
        """Moves the live items to ``running``; returns them less those that had already ended."""
        if not live:
            return []
        running = [task_state(self.worker_id, batch, item, TaskStatus.RUNNING) for item in live]
        applied = await self.retry("marking tasks running", lambda: self.store.apply(running))
        refused = [item.task_id for item, ok in zip(live, applied, strict=True) if not ok]
        if not refused:
            return live
        # Refused: the task ended (cancelled, expired, done by an earlier delivery), or it is already
        # running because this is a redelivery; only the ended ones are dropped.
        current: dict[str, TaskState] = await self.retry("reading tasks", lambda: self.store.get_many(refused))
        ended = {task_id for task_id, state in current.items() if state.status.terminal}
        if ended and self.keep_ended:
            self._ended_before.setdefault(batch.batch_id, []).extend(current[task_id] for task_id in ended)
        if ended:
            log.info(
                "worker %s: %d task(s) of batch %s already ended (cancelled, expired or answered); not running them",
                self.worker_id,
                len(ended),
                batch.batch_id,
                extra=logs.ids(batch_id=batch.batch_id, traceparent=batch.traceparent),
            )
        return [item for item in live if item.task_id not in ended]

    def ended_before(self, batch_id: str) -> list[TaskState]:
        """The kept states of the batch's tasks that had ended before it ran (see ``keep_ended``)."""
        return self._ended_before.pop(batch_id, [])
