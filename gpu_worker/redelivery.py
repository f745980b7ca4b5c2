"""Runs a batch delivered again by its careful plan (``careful.plan``): the worker's I/O around it.

What was in flight when the last holder died comes from the ``DeliveryLog``; the items of each group
that could no longer be answered in time end ``expired``, the others are marked in flight before they
run and their results are stored at once, so the next death narrows the suspects; a proven culprit
is marked, sent to the dead-letter topic, then ended ``failed``, in that order, so a worker that dies
halfway leaves it to the next delivery.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

from gpu_worker import careful
from gpu_worker.calls import Failure, GroupResult
from gpu_worker.settings import WorkerSettings
from gpu_worker.states import task_state, wall_ms
from schemas.deadletter import DEAD_LETTERED
from schemas.records import Batch, BatchItem, TaskState, TaskStatus
from telemetry import logs, metrics
from transport.deliveries import DeadLetterSink, DeliveryLog, Suspects
from transport.ports import TaskStore
from transport.retry import Retrying

log = logging.getLogger(__name__)

RunGroup = Callable[[Batch, list[BatchItem], int, GroupResult], Awaitable[list[TaskState]]]
"""One backend call for a group of a batch on its n-th delivery, timed in the ``GroupResult`` it is
given: the group's states (not stored)."""
EndLate = Callable[[Batch, list[BatchItem]], Awaitable[tuple[list[TaskState], list[BatchItem]]]]
"""Ends ``expired`` (stored) the items of a group that a call started now would answer past their
deadline: (their states, the items still to run)."""


class Redelivery:
    """A redelivered batch's run: suspects in halves, each group marked and stored, culprits set aside."""

    def __init__(
        self,
        settings: WorkerSettings,
        store: TaskStore,
        deliveries: DeliveryLog,
        dead_letters: DeadLetterSink,
        retry: Retrying,
        run_group: RunGroup,
        end_late: EndLate,
        start_from: Callable[[float], None],
    ) -> None:
        """``start_from``: takes the call time the batch's last holder expected when it hung, for a worker
        that has timed no call (a fresh process): it runs that batch first."""
        self.worker_id = settings.worker_id
        self.max_deliveries = settings.max_deliveries
        self.store = store
        self.deliveries = deliveries
        self.dead_letters = dead_letters
        self._retry = retry
        self._run_group = run_group
        self._end_late = end_late
        self._start_from = start_from

    async def run(
        self, batch: Batch, todo: list[BatchItem], count: int, receipt: str
    ) -> tuple[list[TaskState], GroupResult]:
        """Runs ``todo`` of ``batch`` on its ``count``-th delivery, received as ``receipt`` (as it was
        counted); returns every state it stored, and when its first call began and its last ended (the
        batch's ``backend`` span)."""
        # Every task of the batch, those that ended since included: an input is proven the culprit
        # only if nothing else was in flight at the death, not merely nothing else still to run.
        ids = [item.task_id for item in batch.items]
        suspects = await self._retry(
            "reading what was in flight", lambda: self.deliveries.suspects(batch.batch_id, ids, receipt)
        )
        if suspects.call_s is not None:
            self._start_from(suspects.call_s)
        decided = careful.plan(todo, lambda item: item.task_id, suspects, self.max_deliveries)
        metrics.REDELIVERED.labels(worker=self.worker_id).inc()
        gone = "handed it back" if suspects.handed_back else "died, or could not record its hand-back"
        log.warning(
            "worker %s: batch %s is delivered for the %s time (%s); %d of %d tasks were in flight then; "
            "running %s, dead-lettering %d",
            self.worker_id,
            batch.batch_id,
            careful.ordinal(count),
            suspects.note or f"its last holder {gone}",
            len(suspects.task_ids),
            len(batch.items),
            "+".join(str(len(group)) for group in decided.groups) or "nothing",
            len(decided.dead),
            extra=logs.ids(batch_id=batch.batch_id, traceparent=batch.traceparent),
        )
        stored = await self._dead_letter(batch, decided.dead, suspects, count) if decided.dead else []
        calls = GroupResult()
        for group in decided.groups:
            # The groups run one call after another: one that waited behind the others' calls may no
            # longer end by its items' deadlines (a synchronous caller is answered 504 at its own).
            late, group = await self._end_late(batch, group)
            stored.extend(late)
            if not group:
                continue
            mark = functools.partial(self.deliveries.mark, batch.batch_id, [item.task_id for item in group])
            await self._retry("marking tasks in flight", mark)
            timed = GroupResult()
            states = await self._run_group(batch, group, count, timed)
            if calls.started is None:
                calls.started = timed.started
            calls.ended = timed.ended if timed.ended is not None else calls.ended
            await self._retry("storing results", functools.partial(self.store.apply, states))
            stored.extend(states)
        return stored, calls

    async def _dead_letter(
        self, batch: Batch, items: list[BatchItem], suspects: Suspects, count: int
    ) -> list[TaskState]:
        task_ids = [item.task_id for item in items]
        # Marked first: if this worker dies before the letter is stored, the next one sees it again.
        await self._retry("marking tasks in flight", lambda: self.deliveries.mark(batch.batch_id, task_ids))
        letter = careful.dead_letter(batch, items, suspects, count, self.worker_id, wall_ms())
        await self._retry("sending to the dead-letter topic", lambda: self.dead_letters.send(letter))
        where = logs.ids(batch_id=batch.batch_id, traceparent=batch.traceparent)
        message = "worker %s: dead-lettered %s of batch %s: %s"
        log.error(message, self.worker_id, task_ids, batch.batch_id, letter.error, extra=where)
        failure = Failure(DEAD_LETTERED, careful.dead_lettered_message(letter, self.dead_letters.where))
        states = [task_state(self.worker_id, batch, item, TaskStatus.FAILED, None, failure) for item in items]
        await self._retry("storing dead-lettered tasks", lambda: self.store.apply(states))
        metrics.WORKER_BATCHES.labels(worker=self.worker_id, outcome="dead_lettered").inc()
        return states
