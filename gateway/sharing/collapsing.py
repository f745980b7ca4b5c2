"""Request collapsing: identical synchronous requests in flight share one computation.

Each caller keeps a task of its own (its id, its record, its answer); the computation is a task of
the gateway's, with an id no caller holds, published once. When it ends, its state is copied onto
every caller still attached, in one store write, and each caller is answered. So a caller who
leaves (a disconnect, a deadline, ``DELETE`` of its task) ends only its own task: the computation
runs on for the others, and is cancelled only when the last caller has left. A request joins a
computation whose deadline falls at most ``JOIN_SLACK`` of its own timeout before its own deadline
(identical requests sent a moment apart with the same timeout share) and was sent at its tier or a
higher one; one that would wait longer, or at a lower tier, starts a computation of its own, which new
identical requests then join. Whichever of a key's computations completes first answers the callers of
all of them; the others, left with no caller, are cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from gateway.answers.replies import LAST_LOOK_S, Replies
from gateway.answers.waiters import CallerGone, Watch
from gateway.background import Background
from gateway.clock import Clock
from gateway.errors import TRANSPORT_ERRORS, ClientDisconnected, DeadlineExceeded, NotReady, Unavailable
from gateway.publisher import TaskPublisher
from gateway.submission import Submission
from schemas.records import Priority, TaskState, TaskStatus
from telemetry import spans, tracing
from telemetry.logs import ids
from telemetry.metrics import COLLAPSED
from transport.ports import TaskStore

log = logging.getLogger(__name__)

JOIN_SLACK = 0.1
"""The share of a caller's timeout by which the computation it joins may end before the caller's
own deadline: at most that much earlier may it be answered ``deadline_exceeded``."""

KeepAnswer = Callable[[str, TaskState], Awaitable[None]]
"""Called with each computation's key and end state (the result cache keeps the completed ones)."""

Computed = Callable[[str, float], None]
"""Called with a completed computation's model and its duration from publish to answer: a shared
caller's own latency (it may have joined late) is not the model's service time."""


@dataclass(eq=False, slots=True)
class Computation:
    """One published request and the callers waiting for its answer."""

    task_id: str
    model: str
    deadline: float
    tier: Priority
    """The tier its request was sent at: a caller of a higher tier would wait behind work its admission
    did not count, so it starts a computation of its own."""
    callers: dict[str, str | None] = field(default_factory=dict)
    """Each attached caller's task id and owner: its end is written as its own, even where it is the
    task's first write (its queued record could not be written)."""
    queued: TaskState | None = None
    """Its "queued" record once built; written only when it is cancelled (the batcher writes the first)."""
    ended: bool = False
    """Its end state is in: it answers the callers attached now, and no other caller joins it."""


class Collapser:
    """Owns the computations in flight, by key, and the tasks that run them (one ``TaskGroup``)."""

    def __init__(
        self,
        store: TaskStore,
        publisher: TaskPublisher,
        replies: Replies,
        clock: Clock,
        *,
        gateway_id: str,
        keep: KeepAnswer | None = None,
        computed: Computed | None = None,
    ) -> None:
        self._store = store
        self._publisher = publisher
        self._replies = replies
        self._clock = clock
        self._gateway_id = gateway_id
        self._keep = keep
        self._computed = computed
        self._inflight: dict[str, list[Computation]] = {}
        """Each key's computations running, the newest (the one new requests may join) last."""
        self._runs = Background(f"{gateway_id}-collapser")

    def __len__(self) -> int:
        return len(self._inflight)

    @property
    def alive(self) -> bool:
        """Whether the task that holds the computations runs (a crash there turns /readyz red)."""
        return self._runs.alive

    def callers(self, key: str) -> frozenset[str]:
        """The task ids of the callers attached to ``key``'s computation now."""
        return frozenset(caller for computation in self._inflight.get(key, ()) for caller in computation.callers)

    async def start(self) -> None:
        await self._runs.start()

    async def close(self) -> None:
        """Cancels the computations' tasks and waits for them (their callers were woken already)."""
        await self._runs.close()
        self._inflight.clear()

    async def answer(self, key: str, request: Submission, disconnected: Watch | None) -> TaskState:
        """Attaches the caller to ``key``'s computation (starting one if none fits) and waits for
        the caller's own task to end; raises what the caller's answer is instead."""
        if not self._runs.alive:  # a submit that got here as the gateway closed: it starts nothing
            raise NotReady("the gateway is shutting down; retry on another instance")
        future = self._replies.register(request.task_id, request.started, disconnected)
        if tracing.ACTIVE:
            # The caller's own task id on its spans, before a computation it starts publishes under its
            # context (that task copies the context: its id would otherwise be the one the spans carry).
            spans.request_sent(request.task_id)
        computation = self._join(key, request)
        now_ms = self._clock.wall_ms()
        queued = TaskState(
            request.task_id,
            TaskStatus.QUEUED,
            request.model,
            now_ms,
            now_ms,
            reply_to=self._gateway_id,
            owner=request.owner,
            deadline_ms=request.deadline_ms(now_ms),  # a gateway that reads it late ends it, should this one die
        )
        try:
            async with asyncio.timeout_at(request.deadline):
                await self._record(queued)
                state = await future
        except TimeoutError:
            # The computation may have ended in time, its reply unread (``Replies.stored_end``). The caller
            # waits ``LAST_LOOK_S`` at most for the store; its expired end is written on after that.
            looked_until = asyncio.get_running_loop().time() + LAST_LOOK_S
            ended = await self._replies.stored_end(computation.task_id)
            if ended is None:
                await self._publisher.end_unsent(
                    queued,
                    request.timeout_ms,
                    message=f"no answer within timeout_ms={request.timeout_ms}",
                    wait_s=max(0.0, looked_until - asyncio.get_running_loop().time()),
                )
                raise DeadlineExceeded(
                    f"no answer within timeout_ms={request.timeout_ms}; the task ended expired",
                    task_id=request.task_id,
                ) from None
            state = replace(ended, task_id=request.task_id, reply_to=None, owner=request.owner)
            await self._record_ends([state])
        except CallerGone:
            await self._publisher.cancel_abandoned(request.task_id)
            raise ClientDisconnected(
                "the caller closed the connection before the answer; its task was cancelled",
                task_id=request.task_id,
            ) from None
        finally:
            if not future.done():
                future.cancel()
            self._replies.discard(request.task_id)
            await self._leave(key, computation, request.task_id)
        if state.status is TaskStatus.FAILED and state.error_code == Unavailable.code:
            raise Unavailable(state.error_message or "the request bus is unavailable", task_id=request.task_id)
        if state.status is TaskStatus.FAILED and state.error_code == NotReady.code:
            raise NotReady(state.error_message or "the gateway is shutting down", task_id=request.task_id)
        return state

    def joins(self, key: str, request: Submission) -> bool:
        """Whether ``request`` would join ``key``'s computation in flight now (no request of its own is sent)."""
        return self._joinable(key, request) is not None

    def _joinable(self, key: str, request: Submission) -> Computation | None:
        """An identical computation in flight whose deadline is not too early for the caller
        (``JOIN_SLACK``) and whose tier is not below the caller's."""
        running = self._inflight.get(key)
        computation = running[-1] if running else None
        earliest = request.deadline - JOIN_SLACK * request.timeout_ms / 1000
        if computation is not None and computation.deadline >= earliest and computation.tier.rank <= request.tier.rank:
            return computation
        return None

    def _join(self, key: str, request: Submission) -> Computation:
        """The computation this caller waits for: the one in flight it may join (``_joinable``), else a
        new one (which new requests join from then on)."""
        computation = self._joinable(key, request)
        if computation is not None:
            COLLAPSED.labels(model=request.model).inc()
            if request.ticket is not None:
                request.ticket.close()  # never sent: the queue holds the computation's request, not this one's
        else:
            computation = Computation("c-" + secrets.token_urlsafe(16), request.model, request.deadline, request.tier)
            self._runs.spawn(self._run(key, request, computation), name=f"collapsed-{computation.task_id}")
            self._inflight.setdefault(key, []).append(computation)
        computation.callers[request.task_id] = request.owner
        return computation

    async def _leave(self, key: str, computation: Computation, task_id: str) -> None:
        """Detaches a caller; the last one to leave a computation still running cancels it."""
        computation.callers.pop(task_id, None)
        if computation.callers or computation.ended:
            return
        computation.ended = True  # nobody waits for it: it is cancelled, and no one joins it
        self._drop(key, computation)
        try:  # off the caller's answer: a store that does not answer holds no one
            self._runs.spawn(self._cancel(computation), name=f"cancel-{computation.task_id}")
        except RuntimeError:  # the collapser is closing: cancelled here
            await self._cancel(computation)

    async def _cancel(self, computation: Computation) -> None:
        if computation.queued is not None:
            await self._publisher.record_late(computation.queued)  # so that the cancel finds it
        await self._publisher.cancel_abandoned(computation.task_id)

    async def _run(self, key: str, request: Submission, computation: Computation) -> None:
        """Publishes the computation's request, waits for its end, answers every attached caller, then
        hands the end to ``keep``: a slow cache write (up to its store's timeout) must not hold answers
        in hand, nor run their callers past their deadlines. A completed one answers the callers of the
        key's other computations too (one started beside it at a higher tier, or for a later deadline)."""
        state = await self._compute(request, computation)
        computation.ended = True
        self._drop(key, computation)  # from here on a new request joins another, or starts anew
        answered = [computation]
        if state.status is TaskStatus.COMPLETED:
            answered += self._inflight.get(key, ())
        await self._answer_callers(state, tuple(caller for each in answered for caller in each.callers.items()))
        if self._keep is not None:
            await self._keep(key, state)

    def _drop(self, key: str, computation: Computation) -> None:
        running = self._inflight.get(key, [])
        if computation in running:
            running.remove(computation)
        if not running:
            self._inflight.pop(key, None)

    async def _compute(self, request: Submission, computation: Computation) -> TaskState:
        """The computation's end state; a deadline, the bus refusing it or a gateway shutting down
        become an end state too, so every caller is answered the same way."""
        publisher = self._publisher
        queued, sent = publisher.task(request, self._gateway_id, task_id=computation.task_id)
        computation.queued = queued
        started = self._clock.monotonic()
        future = self._replies.register(computation.task_id, started)
        try:
            async with asyncio.timeout_at(computation.deadline):
                await publisher.publish(queued, sent, record=False, ticket=request.ticket)
                state = await future
            if state.status is TaskStatus.COMPLETED and self._computed is not None:
                self._computed(state.model, self._clock.monotonic() - started)
            return state
        except TimeoutError:
            ended = await self._replies.stored_end(computation.task_id)  # its reply may be unread
            if ended is not None:
                return ended
            message = (
                "the computation this request shared with identical ones had no answer within "
                f"timeout_ms={request.timeout_ms} (that of the request that started it); the task ended "
                "expired: retry, or send a longer timeout_ms"
            )
            return self._ended(queued, TaskStatus.EXPIRED, DeadlineExceeded.code, message)
        except (Unavailable, NotReady) as err:  # the bus refused it, or this gateway is closing
            return self._ended(queued, TaskStatus.FAILED, err.code, err.message)
        except Exception as err:  # a store error: every caller hears of it
            log.warning(
                "collapsed computation %s ended without an answer",
                computation.task_id,
                exc_info=True,
                extra=ids(task_id=computation.task_id),
            )
            return self._ended(queued, TaskStatus.FAILED, Unavailable.code, f"the computation failed: {err}")
        finally:
            if not future.done():
                future.cancel()
            self._replies.discard(computation.task_id)

    def _ended(self, queued: TaskState, status: TaskStatus, code: str, message: str) -> TaskState:
        return replace(
            queued, status=status, updated_at_ms=self._clock.wall_ms(), error_code=code, error_message=message
        )

    async def _answer_callers(self, state: TaskState, callers: tuple[tuple[str, str | None], ...]) -> None:
        """Copies the computation's end onto each caller's task, under the caller's own owner (one
        write; a caller cancelled meanwhile keeps its cancel) and hands each its answer. The copies
        are not counted in ``batchwire_tasks_ended``: the computation's end is, once, where it is written."""
        if not callers:
            return
        ended = [replace(state, task_id=task_id, reply_to=None, owner=owner) for task_id, owner in callers]
        for caller_state, written in zip(ended, await self._record_ends(ended), strict=True):
            if written:
                self._replies.deliver(caller_state)

    async def _record_ends(self, ended: list[TaskState]) -> list[bool]:
        """Writes callers' copies of their computation's end, uncounted; a store that fails is logged and
        read as written: the callers are answered all the same, their records stay behind."""
        try:
            return await self._store.apply(ended, counted=False)
        except TRANSPORT_ERRORS:
            log.warning("could not record the answers of %d collapsed callers", len(ended), exc_info=True)
            return [True] * len(ended)

    async def _record(self, queued: TaskState) -> None:
        """The caller's own record, so that it can be read and cancelled while it waits."""
        try:
            await self._store.create(queued)
        except TRANSPORT_ERRORS:
            log.warning(
                "could not record collapsed task %s", queued.task_id, exc_info=True, extra=ids(task_id=queued.task_id)
            )
