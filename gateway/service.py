"""The gateway's work without HTTP: accept a request, publish it, and answer from the task store.

``app.py`` is a thin HTTP skin over :class:`Gateway`; everything here raises the domain errors of
``errors.py``, so it can be driven directly (embedded mode, tests) as well as over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Literal, overload

from gateway import idempotency
from gateway.admission import ANONYMOUS, Admission, Caller
from gateway.changes import follow
from gateway.clock import Clock, SystemClock
from gateway.errors import (
    TRANSPORT_ERRORS,
    ClientDisconnected,
    DeadlineExceeded,
    EmptyInput,
    IdempotencyKeyReused,
    InputTooLarge,
    NotReady,
    Overloaded,
    TaskCancelled,
    TaskFailed,
    TimeoutOutOfRange,
    Unavailable,
    UnknownModel,
)
from gateway.health import probe
from gateway.reads import TaskReads
from gateway.reconnect_recheck import ReconnectRecheck
from gateway.settings import GatewaySettings, env_name
from gateway.waiters import CallerGone, ReplyWaiters, Watch
from schemas.records import InferenceRequest, TaskState, TaskStatus
from telemetry.metrics import INFLIGHT, REQUEST_LATENCY
from transport.ports import KeyClaim, QueueDepth, RateLimiter, RequestProducer, TaskStore

log = logging.getLogger(__name__)

_SWEEP_CHUNK = 500

# A callable that returns an awaitable which completes when the synchronous caller has gone
# (closed its connection), or once its answer was sent (ASGI's receive() does both). The HTTP layer
# builds it; the service never sees the transport.
Disconnected = Watch

CANCELLED_BY_DISCONNECT = "client_disconnected"


@dataclass(frozen=True, slots=True)
class Answer:
    """A synchronous request's output."""

    task_id: str
    model: str
    output: str
    latency_ms: float
    batch_size: int | None
    replayed: bool = False
    """The answer of a task an earlier request with the same Idempotency-Key created."""


@dataclass(frozen=True, slots=True)
class Accepted:
    """An asynchronous request, stored and on the bus."""

    task_id: str
    model: str
    replayed: bool = False
    """An earlier request with the same Idempotency-Key created this task."""
    status: TaskStatus = TaskStatus.QUEUED


class Gateway:
    """Accepts inference requests, produces them to the request bus, and answers from the task store."""

    def __init__(
        self,
        settings: GatewaySettings,
        producer: RequestProducer,
        store: TaskStore,
        clock: Clock | None = None,
        *,
        queue_depth: QueueDepth | None = None,
        limiter: RateLimiter | None = None,
    ) -> None:
        """``queue_depth`` and ``limiter`` enforce ``max_queue_depth`` and the rate limits; without
        them those settings are not applied (the composition roots always pass them)."""
        self.settings = settings
        self._producer = producer
        self._store = store
        self._clock: Clock = clock or SystemClock()
        self._admission = Admission(settings, queue_depth, limiter)
        if settings.rate_limit_per_s > 0 and limiter is None:
            log.warning("rate limits are set but this gateway got no rate limiter: they are not applied")
        self._waiters = ReplyWaiters(settings.reply_recheck_s)
        self._recheck = ReconnectRecheck(store, self._waiters, name=settings.gateway_id)
        self._reads = TaskReads(settings, store)
        self._inflight = 0
        self._accepting = False
        self._sweeper: asyncio.Task[None] | None = None
        self._latency = {model: REQUEST_LATENCY.labels(model=model) for model in settings.models}

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Subscribes to this gateway's replies, starts the lost-reply sweeper and the re-check of held
        callers after a store reconnect; then accepts work."""
        if self._sweeper is not None:
            raise RuntimeError("Gateway.start() called twice")
        await self._store.listen_replies(self.settings.gateway_id, self._waiters.resolve)
        self._sweeper = asyncio.create_task(self._sweep_forever(), name=f"{self.settings.gateway_id}-reply-sweeper")
        self._sweeper.add_done_callback(_log_task_end)
        self._recheck.start()
        await self._admission.start()
        self._accepting = True

    async def close(self) -> None:
        """Stops accepting, wakes the callers still held with ``not_ready``, and stops the sweeper."""
        self._accepting = False
        self._waiters.fail_all(lambda: NotReady("the gateway is shutting down; retry on another instance"))
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None:
            sweeper.cancel()
            await asyncio.wait({sweeper})  # its failure, if any, was logged by _log_task_end
        await self._recheck.close()
        await self._admission.close()
        await self._waiters.stop_watching()

    async def ready(self) -> dict[str, bool]:
        """This gateway's own parts: the bus, the store, and the tasks that guard against lost replies."""
        return {
            "bus": await probe(self._producer.ready(), self.settings.ready_timeout_s, "bus"),
            "store": await probe(self._store.ready(), self.settings.ready_timeout_s, "store"),
            "gateway": self._accepting
            and self._sweeper is not None
            and not self._sweeper.done()
            and self._recheck.alive,
        }

    def models(self) -> dict[str, str]:
        """Each served model: ``serving``, or ``stalled`` (see ``Admission.models``)."""
        return self._admission.models()

    @property
    def inflight(self) -> int:
        """Submissions in progress plus synchronous callers held open."""
        return self._inflight

    @property
    def waiting(self) -> int:
        """Synchronous callers waiting for a reply."""
        return len(self._waiters)

    @property
    def watched(self) -> int:
        """Synchronous callers whose connection is watched (those waiting ``reply_recheck_s`` or longer)."""
        return self._waiters.watched

    @property
    def watchers(self) -> int:
        """Long-polls and event streams open."""
        return self._reads.watchers

    # -- submitting --------------------------------------------------------------------------------

    @overload
    async def submit(
        self,
        input: str,
        model: str | None,
        timeout_ms: int | None,
        wait: Literal[True],
        *,
        caller: Caller = ...,
        idempotency_key: str | None = ...,
        disconnected: Disconnected | None = ...,
    ) -> Answer: ...
    @overload
    async def submit(
        self,
        input: str,
        model: str | None,
        timeout_ms: int | None,
        wait: Literal[False],
        *,
        caller: Caller = ...,
        idempotency_key: str | None = ...,
        disconnected: Disconnected | None = ...,
    ) -> Accepted: ...

    async def submit(
        self,
        input: str,
        model: str | None,
        timeout_ms: int | None,
        wait: bool,
        *,
        caller: Caller = ANONYMOUS,
        idempotency_key: str | None = None,
        disconnected: Disconnected | None = None,
    ) -> Answer | Accepted:
        """Stores and publishes one request; with ``wait``, holds the caller until its answer or deadline.

        ``model`` and ``timeout_ms`` default from the settings; a request may shorten its timeout,
        never lengthen it. With an ``idempotency_key`` that an earlier submit of ``caller.owner``
        used, nothing new is queued: the answer (or acceptance) is that of the earlier task. A
        synchronous caller without a key whose ``disconnected`` completes has its task cancelled;
        with a key the task runs on, for the retry the key announces.
        """
        started = self._clock.monotonic()
        model, timeout_ms = self._validate(input, model, timeout_ms)
        if idempotency_key is not None:
            idempotency.check_key(idempotency_key)
        if not self._accepting:
            raise NotReady("the gateway is not accepting requests (starting or shutting down); retry shortly")
        if not self._producer.reachable():
            # Known down (its circuit breaker is open): refused before anything is stored or queued,
            # rather than after a produce timeout.
            raise Unavailable("the request bus is unreachable; nothing was queued: retry after the Retry-After delay")
        if not self._store.reachable():
            # Known down too: its outage, not the queue that builds meanwhile, is what to report.
            raise Unavailable(
                "the task store is unreachable (its connection is down); nothing was queued: retry shortly"
            )
        if self._inflight >= self.settings.max_inflight:
            raise Overloaded(
                f"this gateway holds {self._inflight} requests, its limit ({env_name('max_inflight')}); "
                "retry after the Retry-After delay"
            )
        self._inflight += 1
        INFLIGHT.inc()
        try:
            if self._admission.active:
                await self._admission.admit(caller, model, timeout_ms)
            if (full := self._store.full(model)) is not None:
                raise Overloaded(full)
            task_id = secrets.token_urlsafe(16)
            deadline = asyncio.get_running_loop().time() + timeout_ms / 1000
            if idempotency_key is None:
                if wait:
                    return await self._answer_when_done(
                        task_id, input, model, timeout_ms, deadline, started, caller.owner, disconnected, keyed=False
                    )
                return await self._enqueue(task_id, input, model, timeout_ms, deadline, caller.owner)
            scope = caller.owner or idempotency.ANONYMOUS_SCOPE
            fingerprint = idempotency.fingerprint(input, model)
            while (claim := await self._claim(scope, idempotency_key, task_id, fingerprint)).task_id != task_id:
                replayed = await self._replay(claim.task_id, model, wait, deadline, started, timeout_ms, caller.owner)
                if not isinstance(replayed, TaskState):
                    return replayed
                # The task ended without being computed while this retry waited for it: the next
                # claim starts a new one (or finds the one a racing retry started).
            try:
                if wait:
                    return await self._answer_when_done(
                        task_id, input, model, timeout_ms, deadline, started, caller.owner, None, keyed=True
                    )
                return await self._enqueue(task_id, input, model, timeout_ms, deadline, caller.owner)
            except Unavailable:
                await self._release(scope, idempotency_key, task_id)  # a retry may then create the task
                raise
        finally:
            self._inflight -= 1
            INFLIGHT.dec()

    async def _answer_when_done(
        self,
        task_id: str,
        input: str,
        model: str,
        timeout_ms: int,
        deadline: float,
        started: float,
        owner: str | None,
        disconnected: Disconnected | None,
        *,
        keyed: bool,
    ) -> Answer:
        """Publishes the request and waits for its reply.

        The task's "queued" record is written only where its id can be asked for before the answer:
        with an idempotency key (a retry reads it) or an owner (who may read it, written only at
        create); else its caller learns the id with the answer, and the batcher's "batched" write
        comes milliseconds later. A 504 and a disconnect, which hand the id out or cancel the task
        early, write it then. Sparing the write takes a Redis command off the common request.
        """
        record = keyed or owner is not None
        queued, request = self._task(task_id, input, model, timeout_ms, self.settings.gateway_id, owner)
        # Register, then publish: the reply may arrive before ``send`` even returns.
        future = self._waiters.register(task_id, started, disconnected)
        published = False
        try:
            async with asyncio.timeout_at(deadline):
                await self._publish(queued, request, record=record)
                published = True
                state = await future
        except TimeoutError:
            # Only our deadline raises it here: a transport's own TimeoutError (an OSError)
            # became Unavailable inside _publish.
            if not published:
                await self._end_unsent(queued, timeout_ms)
            elif not record:
                await self._record_late(queued)
            raise DeadlineExceeded(
                f"no answer within timeout_ms={timeout_ms}; the task may still finish: poll its result",
                task_id=task_id,
            ) from None
        except CallerGone:
            if not record:
                await self._record_late(queued)
            await self._cancel_abandoned(task_id)
            raise ClientDisconnected(
                "the caller closed the connection before the answer; its task was cancelled", task_id=task_id
            ) from None
        finally:
            if not future.done():
                future.cancel()  # a watch that ends from now on (the answer was sent) does nothing
            self._waiters.discard(task_id)
        return self._answer(state, started)

    async def _end_unsent(self, queued: TaskState, timeout_ms: int) -> None:
        """Ends ``expired`` a task whose deadline passed while it was being published: the bus may
        never have taken it, so no batcher would ever end it (were it taken, the batcher's own expiry
        of it changes nothing: a terminal state is written once)."""
        expired = replace(
            queued,
            status=TaskStatus.EXPIRED,
            updated_at_ms=self._clock.wall_ms(),
            error_code=DeadlineExceeded.code,
            error_message=f"timeout_ms={timeout_ms} passed before the request bus took the request; "
            "send a longer timeout_ms",
        )
        try:
            async with asyncio.timeout(self.settings.ready_timeout_s):
                await self._store.apply([expired])
        except (*TRANSPORT_ERRORS, TimeoutError):
            log.warning("could not record task %s as expired", queued.task_id, exc_info=True)

    async def _record_late(self, queued: TaskState) -> None:
        """Writes a task's "queued" record after the fact (a later status that got there first stays);
        bounded, as a 504 waits for it."""
        try:
            async with asyncio.timeout(self.settings.ready_timeout_s):
                await self._store.create(queued)
        except (*TRANSPORT_ERRORS, TimeoutError):
            log.warning("could not record task %s", queued.task_id, exc_info=True)

    async def _cancel_abandoned(self, task_id: str) -> None:
        """Cancels the task of a caller who left, so that no GPU time goes to an answer nobody reads.
        Too late (a worker started it) is fine: the result is stored and pollable."""
        try:
            await self._store.cancel(
                task_id,
                CANCELLED_BY_DISCONNECT,
                "the caller closed the connection before the answer; the task was cancelled",
            )
        except TRANSPORT_ERRORS:
            log.warning("could not cancel task %s of a caller who left", task_id, exc_info=True)

    async def _enqueue(
        self, task_id: str, input: str, model: str, timeout_ms: int, deadline: float, owner: str | None
    ) -> Accepted:
        queued, request = self._task(task_id, input, model, timeout_ms, None, owner)
        try:
            async with asyncio.timeout_at(deadline):
                await self._publish(queued, request, record=True)
        except TimeoutError:
            # The task's own deadline passed while it was being queued: a deadline, like the
            # synchronous route's, whether the bus was stuck or the deadline was just short.
            await self._end_unsent(queued, timeout_ms)
            raise DeadlineExceeded(
                f"timeout_ms={timeout_ms} passed before the task store and the request bus took the request; "
                "send a longer timeout_ms (the task ended expired)",
                task_id=task_id,
            ) from None
        return Accepted(task_id, model)

    async def _claim(self, scope: str, key: str, task_id: str, fingerprint: str) -> KeyClaim:
        """Binds the key to ``task_id`` when it is free, or when the task it names ended without being
        computed (``idempotency.starts_anew``); else returns the binding of the task to replay."""
        try:
            claim = await self._store.claim_key(scope, key, task_id, fingerprint)
            if claim.task_id != task_id and claim.fingerprint == fingerprint:
                earlier = await self._store.get(claim.task_id)  # None: its submit has not stored it yet
                if earlier is not None and idempotency.starts_anew(earlier):
                    claim = await self._store.rebind_key(scope, key, claim.task_id, task_id, fingerprint)
        except TRANSPORT_ERRORS as err:
            raise Unavailable(f"the task store is unavailable: {err}") from err
        if claim.fingerprint != fingerprint:
            raise IdempotencyKeyReused(
                "this Idempotency-Key was used for a request with another input or model; send a new key for "
                "a new request (keys are kept as long as results)"
            )
        return claim

    async def _release(self, scope: str, key: str, task_id: str) -> None:
        try:
            await self._store.release_key(scope, key, task_id)
        except TRANSPORT_ERRORS:
            log.warning("could not release the idempotency key of task %s", task_id, exc_info=True)

    async def _replay(
        self,
        task_id: str,
        model: str,
        wait: bool,
        deadline: float,
        started: float,
        timeout_ms: int,
        owner: str | None,
    ) -> Answer | Accepted | TaskState:
        """The answer to a retry: the earlier task's, waited for up to this request's own deadline.

        The earlier task may not be stored yet (its submit is between claiming the key and storing
        the task, or its record was lost to a store outage after its request was sent), so a missing
        task is waited for rather than reported unknown. An asynchronous retry records it as queued
        (``create`` keeps whatever a batcher or worker stored first, and the original submit's own
        create then finds it): the id it hands out is then one GET can find. A task that ends
        without being computed while a synchronous retry waits, before the retry's own deadline, is
        returned as its state: the retry then starts a task of its own.
        """
        try:
            if not wait:
                state = await self._store.get(task_id)
                if state is None:
                    now_ms = self._clock.wall_ms()
                    await self._store.create(TaskState(task_id, TaskStatus.QUEUED, model, now_ms, now_ms, owner=owner))
                return Accepted(task_id, model, replayed=True, status=state.status if state else TaskStatus.QUEUED)
            async with self._store.watch(task_id) as changes:
                state = await self._store.get(task_id)
                try:
                    async with asyncio.timeout_at(deadline):
                        while state is None:
                            state = await anext(changes)
                except TimeoutError:
                    state = None
                if state is not None and not state.status.terminal:
                    recheck_s = self.settings.reply_recheck_s
                    async with aclosing(follow(self._store, changes, state, deadline, recheck_s)) as later:
                        async for change in later:
                            state = change
        except TRANSPORT_ERRORS as err:
            raise Unavailable(f"the task store is unavailable: {err}") from err
        if state is None or not state.status.terminal:
            raise DeadlineExceeded(
                f"no answer within timeout_ms={timeout_ms} from the task this Idempotency-Key names; it may still "
                "finish: poll its result",
                task_id=task_id,
            )
        if idempotency.starts_anew(state) and asyncio.get_running_loop().time() < deadline:
            return state
        return self._answer(state, started, replayed=True)

    def _validate(self, input: str, model: str | None, timeout_ms: int | None) -> tuple[str, int]:
        settings = self.settings
        if model is None:
            model = settings.default_model
        elif model not in settings.models:
            raise UnknownModel(f"model {model!r} is not served here; served models: {', '.join(settings.models)}")
        if timeout_ms is None:
            timeout_ms = settings.default_timeout_ms
        elif not settings.min_timeout_ms <= timeout_ms <= settings.max_timeout_ms:
            raise TimeoutOutOfRange(
                f"timeout_ms is {timeout_ms}; send a value from {settings.min_timeout_ms} to "
                f"{settings.max_timeout_ms} ({env_name('max_timeout_ms')}), or leave it out for "
                f"{settings.default_timeout_ms}"
            )
        if not input:
            raise EmptyInput("input is empty; send the text to run the model on")
        if len(input) > settings.max_input_chars:
            raise InputTooLarge(
                f"input is {len(input)} characters; the limit is {settings.max_input_chars} "
                f"({env_name('max_input_chars')})"
            )
        return model, timeout_ms

    def _task(
        self, task_id: str, input: str, model: str, timeout_ms: int, reply_to: str | None, owner: str | None
    ) -> tuple[TaskState, InferenceRequest]:
        """A new task's "queued" record and its request."""
        now_ms = self._clock.wall_ms()
        state = TaskState(task_id, TaskStatus.QUEUED, model, now_ms, now_ms, reply_to=reply_to, owner=owner)
        request = InferenceRequest(task_id, model, input, now_ms, now_ms + timeout_ms, reply_to=reply_to, owner=owner)
        return state, request

    async def _publish(self, state: TaskState, request: InferenceRequest, *, record: bool) -> None:
        """Produces the request and, with ``record``, records the task as queued, both at once.

        Neither waits for the other (one round trip off every request's latency): the store's
        ``create`` accepts a task that a batcher or worker reached first and only fills in its
        owner, and a worker stores results whether or not "queued" landed.
        """
        task_id = state.task_id
        # The request first (it is on the answer's path, the record is not), sent from this task: a
        # gather makes two tasks and a gathering future, and making those was ~10 % of the embedded
        # process's py-spy samples at 1,600 req/s. Awaiting the record's task passes a cancellation on.
        creating = asyncio.ensure_future(self._store.create(state)) if record else None
        sent: BaseException | None = None
        try:
            await self._producer.send(request)
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
            if created is True:
                await self._abandon(state, sent)
            raise Unavailable(f"the request bus is unavailable: {sent}", task_id=state.task_id) from sent
        if isinstance(created, BaseException):
            if not isinstance(created, TRANSPORT_ERRORS):
                raise created
            raise Unavailable(
                f"the task store is unavailable: {created}; the request was queued and may still run, "
                f"so retry with an Idempotency-Key or poll /v1/result/{task_id} later",
                task_id=state.task_id,
            ) from created
        # ``created`` False: a retry with this task's Idempotency-Key recorded it queued first (see
        # ``_replay``); ids are 128 random bits, so it is never another task's.

    async def _abandon(self, state: TaskState, err: BaseException) -> None:
        """Marks a task that never reached the bus as failed, so a poller is not left at ``queued``."""
        failed = replace(
            state,
            status=TaskStatus.FAILED,
            updated_at_ms=self._clock.wall_ms(),
            error_code="unavailable",
            error_message=f"the request bus did not take the request: {err}",
        )
        try:
            await self._store.apply([failed])
        except TRANSPORT_ERRORS:
            log.warning("could not mark task %s failed after the bus refused it", state.task_id, exc_info=True)

    def _answer(self, state: TaskState, started: float, replayed: bool = False) -> Answer:
        if state.status is TaskStatus.COMPLETED:
            latency_s = self._clock.monotonic() - started
            histogram = self._latency.get(state.model)
            if histogram is not None and not replayed:
                histogram.observe(latency_s)
                self._admission.answered(state.model, latency_s)
            return Answer(
                state.task_id, state.model, state.output or "", round(latency_s * 1000, 3), state.batch_size, replayed
            )
        if state.status is TaskStatus.CANCELLED:
            raise TaskCancelled(state.error_message or "the task was cancelled", task_id=state.task_id)
        if state.status is TaskStatus.EXPIRED or state.error_code == DeadlineExceeded.code:
            raise DeadlineExceeded(
                state.error_message or "the task expired before a worker ran it", task_id=state.task_id
            )
        raise TaskFailed(
            state.error_message or f"the task ended {state.status.value}",
            task_id=state.task_id,
            task_code=state.error_code,
        )

    async def _sweep_forever(self) -> None:
        """Resolves callers whose reply message was lost, by reading their tasks from the store, and
        starts watching the connections of callers that have waited ``reply_recheck_s``.

        Only waiters older than ``reply_recheck_s`` are looked up (then with a doubling delay), so
        in steady state, answers well under a second, this reads nothing.
        """
        every_s = self.settings.reply_recheck_s
        while True:
            await asyncio.sleep(every_s)
            now = self._clock.monotonic()
            self._waiters.watch_callers(now)
            overdue = self._waiters.due(now, limit=10 * _SWEEP_CHUNK)
            for start in range(0, len(overdue), _SWEEP_CHUNK):
                try:
                    found = await self._store.get_many(overdue[start : start + _SWEEP_CHUNK])
                except TRANSPORT_ERRORS:
                    log.warning("lost-reply sweep could not read the task store; retrying", exc_info=True)
                    break
                for state in found.values():
                    self._waiters.resolve(state)

    # -- reading (TaskReads) -------------------------------------------------------------------

    async def result(self, task_id: str, wait_s: float = 0.0, *, owner: str | None = None) -> TaskState:
        """The task's state; with ``wait_s`` > 0, waits up to that long for it to end (see ``TaskReads``)."""
        return await self._reads.result(task_id, wait_s, owner=owner)

    def events(self, task_id: str, *, owner: str | None = None) -> AsyncGenerator[TaskState, None]:
        """The task's current state, then each later one until it ends (see ``TaskReads``)."""
        return self._reads.events(task_id, owner=owner)

    async def cancel(self, task_id: str, *, owner: str | None = None) -> TaskState:
        """Cancels a task no worker has started yet (see ``TaskReads``)."""
        return await self._reads.cancel(task_id, owner=owner)


def _log_task_end(task: asyncio.Task[None]) -> None:
    """A background task must never die silently: its failure is logged and /readyz turns red."""
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s died", task.get_name(), exc_info=task.exception())
