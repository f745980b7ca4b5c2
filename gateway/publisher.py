"""Putting a new task on its way: its "queued" record in the task store and its request on the bus.

Also ends the tasks that never got there (the bus refused the request, or the deadline passed while
it was sent), so that no poller is left at ``queued``, and cancels the task of a caller who left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

from gateway.background import Background
from gateway.clock import Clock
from gateway.errors import TRANSPORT_ERRORS, DeadlineExceeded, QueuedUnrecorded, Unavailable
from gateway.submission import Submission
from gateway.unseen import Ticket
from schemas.records import InferenceRequest, TaskState, TaskStatus
from telemetry import spans, tracing
from telemetry.logs import ids
from transport.ports import RequestProducer, TaskStore

log = logging.getLogger(__name__)

CANCELLED_BY_DISCONNECT = "client_disconnected"


class TaskPublisher:
    """Records new tasks and produces their requests, and writes the end of those that never ran."""

    def __init__(self, producer: RequestProducer, store: TaskStore, clock: Clock, *, write_timeout_s: float) -> None:
        """``write_timeout_s`` bounds the writes a caller's error answer waits for."""
        self._producer = producer
        self._store = store
        self._clock = clock
        self._write_timeout_s = write_timeout_s
        self._late = Background("late-writes")

    async def start(self) -> None:
        await self._late.start()

    async def close(self) -> None:
        """Cancels the writes still going on in the background (``record_late``, ``end_unsent``)."""
        await self._late.close()

    @property
    def alive(self) -> bool:
        return self._late.alive

    def task(
        self, submission: Submission, reply_to: str | None, *, task_id: str | None = None
    ) -> tuple[TaskState, InferenceRequest]:
        """A new task's "queued" record and its request; ``task_id`` when not the submission's own
        (a collapsed computation's)."""
        task_id = submission.task_id if task_id is None else task_id
        model, owner = submission.model, submission.owner
        now_ms = self._clock.wall_ms()
        deadline_ms = submission.deadline_ms(now_ms)
        state = TaskState(
            task_id, TaskStatus.QUEUED, model, now_ms, now_ms, reply_to=reply_to, owner=owner, deadline_ms=deadline_ms
        )
        traceparent = spans.request_sent(task_id) if tracing.ACTIVE else None
        request = InferenceRequest(
            task_id,
            model,
            submission.input,
            now_ms,
            deadline_ms,
            reply_to=reply_to,
            owner=owner,
            priority=submission.tier,
            traceparent=traceparent,
        )
        return state, request

    async def publish(
        self, state: TaskState, request: InferenceRequest, *, record: bool, ticket: Ticket | None = None
    ) -> None:
        """Produces the request and, with ``record``, records the task as queued, both at once; tells
        admission's ``ticket`` once the request is on the bus.

        Neither waits for the other (one round trip off every request's latency): the store's
        ``create`` accepts a task that a batcher or worker reached first and only fills in its
        owner, and a worker stores results whether or not "queued" landed.
        """
        # The request first (it is on the answer's path, the record is not), sent from this task: a
        # gather would make two more tasks and a gathering future per request. Awaiting the record's
        # task passes a cancellation on.
        creating = asyncio.ensure_future(self._store.create(state)) if record else None
        sent: BaseException | None = None
        try:
            await self._producer.send(request)
            if ticket is not None:
                ticket.sent()
        except asyncio.CancelledError:
            if creating is not None:
                creating.cancel()
            raise
        except Exception as err:
            sent = err
        created: bool | BaseException = True  # with no record, a refused request is still marked failed
        if creating is not None:
            try:
                created = await creating
            except Exception as err:
                created = err
        if sent is not None:
            if not isinstance(sent, TRANSPORT_ERRORS):
                raise sent
            if created is True and await self._abandon(state, sent):
                if ticket is not None:
                    ticket.sent()
                return  # a worker has it after all: its answer comes as any other's
            raise Unavailable(f"the request bus is unavailable: {sent}", task_id=state.task_id) from sent
        if isinstance(created, BaseException):
            if not isinstance(created, TRANSPORT_ERRORS):
                raise created
            raise QueuedUnrecorded(
                f"the task store is unavailable: {created}; the request was queued and may still run, "
                f"so retry with an Idempotency-Key or poll /v1/result/{state.task_id} later",
                task_id=state.task_id,
            ) from created
        # ``created`` False: a retry with this task's Idempotency-Key sent it again and recorded it
        # first (``Gateway._submit_keyed``); ids are 128 random bits, so it is never another task's.

    async def end_unsent(
        self, queued: TaskState, timeout_ms: int, *, message: str | None = None, wait_s: float | None = None
    ) -> None:
        """Ends ``expired`` a task whose deadline passed while it was being published: the bus may
        never have taken it, so no batcher would ever end it (were it taken, the batcher's own expiry
        of it changes nothing: a terminal state is written once). ``message`` says why, when the
        default (``timeout_ms`` passed before the bus took it) is not what happened; ``wait_s`` as
        for ``record_late``."""
        expired = replace(
            queued,
            status=TaskStatus.EXPIRED,
            updated_at_ms=self._clock.wall_ms(),
            error_code=DeadlineExceeded.code,
            error_message=message
            or f"timeout_ms={timeout_ms} passed before the request bus took the request; send a longer timeout_ms",
        )
        await self._write(
            lambda: self._store.apply([expired]), queued.task_id, "could not record task %s as expired", wait_s
        )

    async def record_late(self, queued: TaskState, *, wait_s: float | None = None) -> None:
        """Writes a task's "queued" record after the fact (a later status that got there first stays).
        The record carries no deadline: a worker may be running the task, its "running" unwritten
        (``TaskStore.apply``), and its answer is still to be polled.

        ``wait_s`` bounds the caller's wait (a 504 due now): a store that does not answer then holds
        the caller no longer, and the write goes on in the background, to land once the store answers.
        """
        late = replace(queued, deadline_ms=None)
        await self._write(lambda: self._store.create(late), queued.task_id, "could not record task %s", wait_s)

    async def _write(
        self, write: Callable[[], Awaitable[object]], task_id: str, failed: str, wait_s: float | None
    ) -> None:
        """Runs a store write within ``write_timeout_s``, logging ``failed`` (naming the task) if it fails;
        the caller waits for it ``wait_s`` at most (None: to its end), while the background finishes it."""

        async def bounded() -> None:
            try:
                async with asyncio.timeout(self._write_timeout_s):
                    await write()
            except (*TRANSPORT_ERRORS, TimeoutError):
                log.warning(failed, task_id, exc_info=True, extra=ids(task_id=task_id))

        if wait_s is None:
            await bounded()
            return
        try:
            going = self._late.spawn(bounded(), name=f"write-{task_id}")
        except RuntimeError:  # the background is closed or closing: written here, waited for ``wait_s`` still
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await bounded()
            return
        await asyncio.wait({going}, timeout=wait_s)

    async def cancel_abandoned(self, task_id: str) -> None:
        """Cancels the task of a caller who left, so that no GPU time goes to an answer nobody reads.
        Too late (a worker started it) is fine: the result is stored and pollable."""
        try:
            await self._store.cancel(
                task_id,
                CANCELLED_BY_DISCONNECT,
                "the caller closed the connection before the answer; the task was cancelled",
            )
        except TRANSPORT_ERRORS:
            log.warning(
                "could not cancel task %s of a caller who left", task_id, exc_info=True, extra=ids(task_id=task_id)
            )

    async def _abandon(self, state: TaskState, err: BaseException) -> bool:
        """Ends a task whose send failed before any worker started it, so that none ever does: a send
        that timed out may still have reached the bus, and a request answered 503 must not be
        computed (a retry with its Idempotency-Key then starts anew, and would compute it twice).
        Returns True when a worker started it first (or it ended otherwise): the bus had it, and no 503
        is due; the caller's answer comes as any other's."""
        message = f"the request bus did not take the request: {err}"
        try:
            ended = await self._store.cancel(state.task_id, "unavailable", message, TaskStatus.FAILED)
            if ended is None:  # not recorded (a synchronous request's record is optional): no worker wrote it either
                failed = replace(
                    state,
                    status=TaskStatus.FAILED,
                    updated_at_ms=self._clock.wall_ms(),
                    error_code="unavailable",
                    error_message=message,
                )
                await self._store.apply([failed])
        except TRANSPORT_ERRORS:
            log.warning(
                "could not end task %s after the bus refused it",
                state.task_id,
                exc_info=True,
                extra=ids(task_id=state.task_id),
            )
            return False
        # Ours (or an earlier abandon's) is failed/unavailable; anything else a worker or the caller wrote.
        return ended is not None and (ended.status, ended.error_code) != (TaskStatus.FAILED, "unavailable")
