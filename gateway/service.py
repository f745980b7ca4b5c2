"""The gateway's work without HTTP: accept a request, publish it, and answer from the task store.

``app.py`` is a thin HTTP skin over :class:`Gateway`; everything here raises the domain errors of
``errors.py``, so it can be driven directly (embedded mode, tests) as well as over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, replace
from typing import Literal, overload

from batchwire.metrics import INFLIGHT, REQUEST_LATENCY
from batchwire.transport.base import RequestProducer, TaskStore, TransportError
from gateway.changes import follow
from gateway.clock import Clock, SystemClock
from gateway.errors import (
    DeadlineExceeded,
    EmptyInput,
    InputTooLarge,
    InvalidTaskId,
    NotReady,
    Overloaded,
    TaskFailed,
    TaskNotFound,
    TimeoutOutOfRange,
    Unavailable,
    UnknownModel,
    ValidationFailed,
)
from gateway.health import probe
from gateway.settings import GatewaySettings, env_name
from gateway.waiters import ReplyWaiters
from schemas.records import InferenceRequest, TaskState, TaskStatus

log = logging.getLogger(__name__)

# Task ids are ours (``secrets.token_urlsafe``), but a client may send anything: keep odd
# characters out of store keys and channel names.
TASK_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,128}")

_SWEEP_CHUNK = 500
# Errors of the bus and the store: a TransportError, or a client library's connection error that
# the transport did not wrap.
_TRANSPORT_ERRORS = (TransportError, OSError)


@dataclass(frozen=True, slots=True)
class Answer:
    """A synchronous request's output."""

    task_id: str
    model: str
    output: str
    latency_ms: float
    batch_size: int | None


@dataclass(frozen=True, slots=True)
class Accepted:
    """An asynchronous request, stored and on the bus."""

    task_id: str
    model: str


class Gateway:
    """Accepts inference requests, produces them to the request bus, and answers from the task store."""

    def __init__(
        self,
        settings: GatewaySettings,
        producer: RequestProducer,
        store: TaskStore,
        clock: Clock | None = None,
    ) -> None:
        self.settings = settings
        self._producer = producer
        self._store = store
        self._clock: Clock = clock or SystemClock()
        self._waiters = ReplyWaiters(settings.reply_recheck_s)
        self._inflight = 0
        self._watchers = 0
        self._accepting = False
        self._sweeper: asyncio.Task[None] | None = None
        self._latency = {model: REQUEST_LATENCY.labels(model=model) for model in settings.models}

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Subscribes to this gateway's replies and starts the lost-reply sweeper; then accepts work."""
        if self._sweeper is not None:
            raise RuntimeError("Gateway.start() called twice")
        await self._store.listen_replies(self.settings.gateway_id, self._waiters.resolve)
        self._sweeper = asyncio.create_task(self._sweep_forever(), name=f"{self.settings.gateway_id}-reply-sweeper")
        self._sweeper.add_done_callback(_log_task_end)
        self._accepting = True

    async def close(self) -> None:
        """Stops accepting, wakes the callers still held with ``not_ready``, and stops the sweeper."""
        self._accepting = False
        self._waiters.fail_all(lambda: NotReady("the gateway is shutting down; retry on another instance"))
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None:
            sweeper.cancel()
            await asyncio.wait({sweeper})  # its failure, if any, was logged by _log_task_end

    async def ready(self) -> dict[str, bool]:
        """This gateway's own parts: the bus, the store, and the sweeper that guards against lost replies."""
        return {
            "bus": await probe(self._producer.ready(), self.settings.ready_timeout_s, "bus"),
            "store": await probe(self._store.ready(), self.settings.ready_timeout_s, "store"),
            "gateway": self._accepting and self._sweeper is not None and not self._sweeper.done(),
        }

    @property
    def inflight(self) -> int:
        """Submissions in progress plus synchronous callers held open."""
        return self._inflight

    @property
    def waiting(self) -> int:
        """Synchronous callers waiting for a reply."""
        return len(self._waiters)

    @property
    def watchers(self) -> int:
        """Long-polls and event streams open."""
        return self._watchers

    # -- submitting --------------------------------------------------------------------------------

    @overload
    async def submit(self, input: str, model: str | None, timeout_ms: int | None, wait: Literal[True]) -> Answer: ...
    @overload
    async def submit(self, input: str, model: str | None, timeout_ms: int | None, wait: Literal[False]) -> Accepted: ...

    async def submit(self, input: str, model: str | None, timeout_ms: int | None, wait: bool) -> Answer | Accepted:
        """Stores and publishes one request; with ``wait``, holds the caller until its answer or deadline.

        ``model`` and ``timeout_ms`` default from the settings; a request may shorten its timeout,
        never lengthen it.
        """
        started = self._clock.monotonic()
        model, timeout_ms = self._validate(input, model, timeout_ms)
        if not self._accepting:
            raise NotReady("the gateway is not accepting requests (starting or shutting down); retry shortly")
        if self._inflight >= self.settings.max_inflight:
            raise Overloaded(
                f"this gateway holds {self._inflight} requests, its limit ({env_name('max_inflight')}); "
                "retry after the Retry-After delay"
            )
        self._inflight += 1
        INFLIGHT.inc()
        try:
            task_id = secrets.token_urlsafe(16)
            deadline = asyncio.get_running_loop().time() + timeout_ms / 1000
            if wait:
                return await self._answer_when_done(task_id, input, model, timeout_ms, deadline, started)
            return await self._enqueue(task_id, input, model, timeout_ms, deadline)
        finally:
            self._inflight -= 1
            INFLIGHT.dec()

    async def _answer_when_done(
        self, task_id: str, input: str, model: str, timeout_ms: int, deadline: float, started: float
    ) -> Answer:
        # Register, then publish: the reply may arrive before ``send`` even returns.
        future = self._waiters.register(task_id, started)
        try:
            async with asyncio.timeout_at(deadline):
                await self._publish(task_id, input, model, timeout_ms, self.settings.gateway_id)
                state = await future
        except TimeoutError:
            # Only our deadline raises it here: a transport's own TimeoutError (an OSError)
            # became Unavailable inside _publish.
            raise DeadlineExceeded(
                f"no answer within timeout_ms={timeout_ms}; the task may still finish: poll its result",
                task_id=task_id,
            ) from None
        finally:
            self._waiters.discard(task_id)
        return self._answer(state, started)

    async def _enqueue(self, task_id: str, input: str, model: str, timeout_ms: int, deadline: float) -> Accepted:
        try:
            async with asyncio.timeout_at(deadline):
                await self._publish(task_id, input, model, timeout_ms, None)
        except TimeoutError:
            raise Unavailable(
                f"the task store or the request bus did not take the request within timeout_ms={timeout_ms}",
                task_id=task_id,
            ) from None
        return Accepted(task_id, model)

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

    async def _publish(self, task_id: str, input: str, model: str, timeout_ms: int, reply_to: str | None) -> None:
        """Records the task as queued, then produces the request, so that a task is in the store
        before any worker can finish it."""
        now_ms = self._clock.wall_ms()
        state = TaskState(task_id, TaskStatus.QUEUED, model, now_ms, now_ms, reply_to=reply_to)
        request = InferenceRequest(task_id, model, input, now_ms, now_ms + timeout_ms, reply_to=reply_to)
        try:
            created = await self._store.create(state)
        except _TRANSPORT_ERRORS as err:
            raise Unavailable(f"the task store is unavailable: {err}") from err
        if not created:
            raise RuntimeError(f"task id {state.task_id!r} exists already; ids must be unique")
        try:
            await self._producer.send(request)
        except _TRANSPORT_ERRORS as err:
            await self._abandon(state, err)
            raise Unavailable(f"the request bus is unavailable: {err}", task_id=state.task_id) from err

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
        except _TRANSPORT_ERRORS:
            log.warning("could not mark task %s failed after the bus refused it", state.task_id, exc_info=True)

    def _answer(self, state: TaskState, started: float) -> Answer:
        if state.status is TaskStatus.COMPLETED:
            latency_s = self._clock.monotonic() - started
            histogram = self._latency.get(state.model)
            if histogram is not None:
                histogram.observe(latency_s)
            return Answer(state.task_id, state.model, state.output or "", round(latency_s * 1000, 3), state.batch_size)
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
        """Resolves callers whose reply message was lost, by reading their tasks from the store.

        Only waiters older than ``reply_recheck_s`` are looked up (then with a doubling delay), so
        in steady state, answers well under a second, this reads nothing.
        """
        every_s = self.settings.reply_recheck_s
        while True:
            await asyncio.sleep(every_s)
            overdue = self._waiters.due(self._clock.monotonic(), limit=10 * _SWEEP_CHUNK)
            for start in range(0, len(overdue), _SWEEP_CHUNK):
                try:
                    found = await self._store.get_many(overdue[start : start + _SWEEP_CHUNK])
                except _TRANSPORT_ERRORS:
                    log.warning("lost-reply sweep could not read the task store; retrying", exc_info=True)
                    break
                for state in found.values():
                    self._waiters.resolve(state)

    # -- reading -------------------------------------------------------------------------------

    async def result(self, task_id: str, wait_s: float = 0.0) -> TaskState:
        """The task's state; with ``wait_s`` > 0, waits up to that long for it to end (long-poll)."""
        _check_task_id(task_id)
        if not 0 <= wait_s <= self.settings.max_wait_s:
            raise ValidationFailed(
                f"wait is {wait_s}; send seconds from 0 to {self.settings.max_wait_s} ({env_name('max_wait_s')})"
            )
        try:
            if wait_s == 0:
                return await self._get(task_id)
            with self._watching():
                async with self._store.watch(task_id) as changes:
                    state = await self._get(task_id)
                    if state.status.terminal:
                        return state
                    try:
                        async with asyncio.timeout(wait_s):
                            async for change in changes:
                                if change.status.rank > state.status.rank:
                                    state = change
                                if state.status.terminal:
                                    return state
                    except TimeoutError:
                        pass
            # The wait ran out: read once more, in case a change message was lost on the way.
            return await self._store.get(task_id) or state
        except _TRANSPORT_ERRORS as err:
            raise Unavailable(f"the task store is unavailable: {err}") from err

    async def events(self, task_id: str) -> AsyncGenerator[TaskState, None]:
        """The task's current state, then each later state, until it ends (or ``sse_max_s`` passes).

        Never yields a status twice nor goes back: only states of a higher rank than the last are
        yielded. Use with ``contextlib.aclosing`` so the store subscription ends with the consumer.
        """
        _check_task_id(task_id)
        deadline = asyncio.get_running_loop().time() + self.settings.sse_max_s
        try:
            with self._watching():
                async with self._store.watch(task_id) as changes:
                    state = await self._get(task_id)
                    yield state
                    async with aclosing(
                        follow(self._store, changes, state, deadline, self.settings.stream_recheck_s)
                    ) as later:
                        async for state in later:
                            yield state
        except _TRANSPORT_ERRORS as err:
            raise Unavailable(f"the task store is unavailable: {err}") from err

    async def _get(self, task_id: str) -> TaskState:
        state = await self._store.get(task_id)
        if state is None:
            raise TaskNotFound(f"no task {task_id!r}: it never existed here, or it expired from the store")
        return state

    @contextmanager
    def _watching(self) -> Iterator[None]:
        if self._watchers >= self.settings.max_watchers:
            raise Overloaded(
                f"this gateway has {self._watchers} long-polls and event streams open, its limit "
                f"({env_name('max_watchers')}); retry after the Retry-After delay"
            )
        self._watchers += 1
        try:
            yield
        finally:
            self._watchers -= 1


def _check_task_id(task_id: str) -> None:
    if not TASK_ID_PATTERN.fullmatch(task_id):
        raise InvalidTaskId("a task id is 1 to 128 characters from A-Z a-z 0-9 _ -; use the task_id a submit returned")


def _log_task_end(task: asyncio.Task[None]) -> None:
    """A background task must never die silently: its failure is logged and /readyz turns red."""
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s died", task.get_name(), exc_info=task.exception())
