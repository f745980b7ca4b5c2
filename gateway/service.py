"""The gateway's work without HTTP: accept a request, publish it, and answer from the task store.

``gateway.edge.routes`` is a thin HTTP skin over :class:`Gateway`; everything here raises the domain
errors of ``errors.py``, so it can be driven directly (embedded mode, tests) as well as over HTTP.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Literal, overload

from gateway.admission.gate import ANONYMOUS, Admission, Caller
from gateway.admission.priority import request_tier
from gateway.admission.validation import TokenBudget, validated
from gateway.answers.outcomes import Accepted, Answer, answer_of
from gateway.answers.reads import TaskReads
from gateway.answers.replies import LAST_LOOK_S, Replies
from gateway.answers.waiters import CallerGone, Watch, unless_gone
from gateway.clock import Clock, SystemClock
from gateway.errors import (
    ClientDisconnected,
    DeadlineExceeded,
    NotReady,
    Overloaded,
    QueuedUnrecorded,
    Unavailable,
    ValidationFailed,
)
from gateway.keys import idempotency
from gateway.keys.replay import UNSTORED_GRACE_S, KeyedReplay
from gateway.publisher import TaskPublisher
from gateway.settings import GatewaySettings, env_name
from gateway.sharing.shared import SharedAnswers
from gateway.submission import Submission
from schemas.records import TaskState, TaskStatus
from telemetry import spans, tracing
from telemetry.logs import ids
from telemetry.metrics import INFLIGHT, REQUEST_LATENCY
from transport.ports import CreditPool, KeyClaim, QueueDepth, RateLimiter, RequestProducer, ResultCache, TaskStore

log = logging.getLogger(__name__)

# A callable that returns an awaitable which completes when the synchronous caller has gone
# (closed its connection), or once its answer was sent (ASGI's receive() does both). The HTTP layer
# builds it; the service never sees the transport.
Disconnected = Watch


@dataclass(frozen=True, slots=True)
class ClientPart:
    """What ``submit`` checked of its caller's limits before the queue's checks (its rate-limit token,
    its token count: ``weight``), carried to where a shared or keyed request learns whether it is
    queued at all (``Gateway._queued``). ``charged``: taken for several inputs at once (``charge``),
    so a refusal of this one gives back nothing."""

    caller: Caller
    charged: bool
    weight: int | None


class Gateway:
    """Takes a request from admission to its answer: checks and admits it, publishes it, and answers
    its caller from the reply or the task store."""

    def __init__(
        self,
        settings: GatewaySettings,
        producer: RequestProducer,
        store: TaskStore,
        clock: Clock | None = None,
        *,
        queue_depth: QueueDepth | None = None,
        limiter: RateLimiter | None = None,
        cache: ResultCache | None = None,
        credits: CreditPool | None = None,
        count_tokens: Callable[[str], int] | None = None,
    ) -> None:
        """``queue_depth`` and ``limiter`` enforce ``max_queue_depth`` and the rate limits; without
        them those settings are not applied (the composition roots always pass them). ``cache``
        holds answers for ``cache_ttl_s``; ``credits`` is the workers' credit pool, read for the
        rates they state (admission by predicted wait before a model's drain rate is measured).
        ``count_tokens`` (with ``max_batch_tokens``) refuses an input over the token budget."""
        self.settings = settings
        self._token_budget = (
            TokenBudget(settings, count_tokens) if count_tokens is not None and settings.max_batch_tokens > 0 else None
        )
        self._producer = producer
        self._store = store
        self._clock: Clock = clock or SystemClock()
        self._admission = Admission(settings, queue_depth, limiter, credits)
        if settings.rate_limit_per_s > 0 and limiter is None:
            log.warning("rate limits are set but this gateway got no rate limiter: they are not applied")
        self._replies = Replies(store, self._clock, first_check_s=settings.reply_recheck_s, name=settings.gateway_id)
        self._publisher = TaskPublisher(producer, store, self._clock, write_timeout_s=settings.ready_timeout_s)
        self._reads = TaskReads(settings, store, self._clock)
        self._keys = KeyedReplay(
            store, self._clock, self._reads, recheck_s=settings.reply_recheck_s, name=settings.gateway_id
        )
        self._shared = SharedAnswers(
            settings, store, self._publisher, self._replies, self._clock, cache, computed=self._admission.answered
        )
        self._inflight = 0
        self._accepting = False
        self._latency = {model: REQUEST_LATENCY.labels(model=model) for model in settings.models}

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Subscribes to this gateway's replies and starts their store look-ups (``Replies``); then
        accepts work."""
        await self._replies.start()
        await self._admission.start()
        await self._shared.start()
        await self._keys.start()
        await self._publisher.start()
        self._accepting = True

    async def close(self) -> None:
        """Stops accepting, wakes the callers still held with ``not_ready``, and stops the look-ups."""
        self._accepting = False
        await self._replies.close(lambda: NotReady("the gateway is shutting down; retry on another instance"))
        await self._shared.close()
        await self._keys.close()
        await self._admission.close()
        await self._publisher.close()
        if self._token_budget is not None:
            self._token_budget.close()

    def ready(self) -> dict[str, bool]:
        """This gateway's own part: accepting, with the tasks that guard against lost replies, finish
        late writes and sample the admission alive. The transports are the composition root's to probe
        (``Lifecycle.ready``), once each."""
        alive = (
            self._replies.alive
            and self._shared.alive
            and self._keys.alive
            and self._admission.alive
            and self._publisher.alive
        )
        return {"gateway": self._accepting and alive}

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
        return len(self._replies)

    @property
    def watched(self) -> int:
        """Synchronous callers whose connection is watched (those waiting ``reply_recheck_s`` or longer)."""
        return self._replies.watched

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
        priority: str | None = ...,
        charged: bool = ...,
        weight: int | None = ...,
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
        priority: str | None = ...,
        charged: bool = ...,
        weight: int | None = ...,
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
        priority: str | None = None,
        charged: bool = False,
        weight: int | None = None,
    ) -> Answer | Accepted:
        """Stores and publishes one request; with ``wait``, holds the caller until its answer or deadline.

        ``model`` and ``timeout_ms`` default from the settings; a request may shorten its timeout,
        never lengthen it. With an ``idempotency_key`` that an earlier submit of ``caller.owner``
        used, nothing new is queued: the answer (or acceptance) is that of the earlier task. A
        synchronous caller whose ``disconnected`` completes is let go, and its task cancelled; with a
        key the task runs on, for the retry the key announces. ``priority`` names the tier
        (``gateway.admission.priority``: the key's default when None, never above its ceiling).
        ``charged``: the request is one input of several whose rate-limit tokens ``charge`` took, and
        ``weight`` its tokens that ``charge`` counted.
        """
        started = self._clock.monotonic()
        # The caller's deadline runs from here: admission's own waits (the rate limiter's store, the token
        # count) come out of it, not on top of it.
        accepted = asyncio.get_running_loop().time()
        model, timeout_ms = validated(self.settings, input, model, timeout_ms)
        tier = request_tier(priority, caller.tiers)
        if idempotency_key is not None:
            idempotency.check_key(idempotency_key)
        key = self._shared.keys.key(caller.owner, model, input) if idempotency_key is None else None
        self._check_open(cache_first=wait and key is not None)
        self._inflight += 1
        INFLIGHT.inc()
        ticket = None
        # The token count comes last, once the cheaper checks and the rate limit let the request through
        # (admission runs it after taking the token); a charged input's was run by ``charge``.
        count = None if self._token_budget is None else functools.partial(self._token_budget.check, input)
        try:
            # Before admission, which takes the client's rate-limit token: a request refused here takes none.
            # A shared or keyed one may add no input (a cache hit, a join, a retry): it is checked once that
            # is known (``_queued``).
            if key is None and idempotency_key is None and (full := self._store.full(model)) is not None:
                raise Overloaded(full)
            if self._admission.active:
                check = None if charged else count
                if key is None and idempotency_key is None:
                    ticket = await self._admission.admit(
                        caller, model, timeout_ms, tier, charged=charged, check=check, weight=weight
                    )
                # A shared answer, or a retry of a keyed task, may need no queue work: its client's part
                # is checked now, its queue's only once that is known (``_submit_shared``, ``_submit_keyed``).
                elif not charged and (weights := await self._admission.charge(caller, 1, check)):
                    weight = weights[0]
            elif count is not None and not charged:
                await count()
            deadline = accepted + timeout_ms / 1000
            task_id = secrets.token_urlsafe(16)
            submission = Submission(task_id, input, model, timeout_ms, deadline, started, caller.owner, tier, ticket)
            if key is not None:
                part = ClientPart(caller, charged, weight)
                return await self._submit_shared(key, submission, wait, disconnected, part)
            if idempotency_key is not None:
                part = ClientPart(caller, charged, weight)
                return await self._submit_keyed(submission, wait, idempotency_key, disconnected, part)
            if wait:
                answer = await self._answer_when_done(submission, disconnected, keyed=False)
                self._admission.count(model, tier, "answered")
                return answer
            return await self._enqueue(submission)
        finally:
            if ticket is not None:
                ticket.close()
            self._inflight -= 1
            INFLIGHT.dec()

    def _check_open(self, *, cache_first: bool = False) -> None:
        """Refuses a submit before anything is stored or queued: not accepting, a transport known down
        (its circuit breaker is open, rather than after a timeout), a store that refuses writes, or this
        gateway full. ``cache_first``: a store that refuses writes refuses it only if the result cache has no
        answer (``_submit_shared``)."""
        if not self._accepting:
            raise NotReady("the gateway is not accepting requests (starting or shutting down); retry shortly")
        if not self._producer.reachable():
            raise Unavailable("the request bus is unreachable; nothing was queued: retry after the Retry-After delay")
        if not self._store.reachable():
            # Its outage, not the queue that builds meanwhile, is what to report.
            raise Unavailable("the task store is unreachable (its connection is down); nothing was queued; retry soon")
        if not cache_first and (refusal := self._store.refuses_writes()) is not None:
            raise Unavailable(refusal)  # an answer could not be stored
        if self._inflight >= self.settings.max_inflight:
            raise Overloaded(
                f"this gateway holds {self._inflight} requests, its limit ({env_name('max_inflight')}); "
                "retry after the Retry-After delay"
            )

    async def charge(
        self, caller: Caller, inputs: Sequence[str], model: str | None, names: Sequence[str]
    ) -> Sequence[int] | None:
        """Takes the rate-limit tokens of a request of several ``inputs`` at once, before their submits
        (``charged``), so it is admitted whole or refused whole (``Admission.charge``). What refuses an
        input without I/O (its validation; with admission checks, a gateway not open) is checked first,
        and the inputs' token counts last, as a single request's are, whether or not admission has
        checks to run: returns them (None without a token budget), each input's ``weight`` for its
        submit. More inputs than this gateway holds at once (``max_inflight``) would be refused 503 on
        every try, however idle the gateway: that is a 400 naming the limit. ``names``: each input as a
        refusal names it, where its caller sent it (```prompt[2]```)."""
        if len(inputs) > self.settings.max_inflight:
            raise ValidationFailed(
                f"this request holds {len(inputs)} inputs, more than this gateway holds at once "
                f"({env_name('max_inflight')} = {self.settings.max_inflight}); "
                f"send at most {self.settings.max_inflight} per request"
            )
        for input, name in zip(inputs, names, strict=True):
            validated(self.settings, input, model, None, name=name)
        budget = self._token_budget
        count = None if budget is None else functools.partial(budget.check, *inputs, names=names)
        if not self._admission.active:
            # No token to take, but the count still comes before any input is queued: counted in its own
            # submit, an input over the budget was refused with the others already on the bus. The
            # gateway's state is each submit's to check (a cached answer is served while the store
            # refuses writes).
            return None if count is None else await count()
        self._check_open()
        return await self._admission.charge(caller, len(inputs), count)

    async def refund(self, caller: Caller, inputs: int) -> None:
        """Gives back the tokens ``charge`` took for a request its queue, or a gateway closing, then
        refused (503): a single request refused so takes none."""
        if self._admission.active:
            await self._admission.refund(caller, inputs)

    async def _submit_keyed(
        self,
        submission: Submission,
        wait: bool,
        key: str,
        disconnected: Disconnected | None,
        part: ClientPart,
    ) -> Answer | Accepted:
        """A submit with an Idempotency-Key: the earlier task's answer, or a new task the key names. A
        caller that hangs up is let go (its wait no longer counts against ``max_inflight``); the task
        runs on for the retry the key announces.

        Only a new task goes through the queue's checks (``_queued``), once its claim bound the key: a
        retry of a task queued or running adds nothing to the queue, and is answered however full it is
        (a client whose response was lost learns its answer, not a 503). A new task the queue refuses
        unbinds the key, as nothing was queued.

        A key bound to a task that is still not stored after ``UNSTORED_GRACE_S`` is one whose submit
        ended before it stored the task, and maybe before it sent its request (the answer to its claim
        was lost with a failed-over Redis primary, or its gateway was killed in between): the retry
        sends that task again (``_resend``), so it ends, once a second claim finds the key still bound to
        it (a submit refused meanwhile releases its key: the retry then binds it to its own task). A
        request sent twice is computed twice at worst, and answered once. One with less than
        ``UNSTORED_GRACE_S`` left before its deadline would expire on its way: it is ended ``expired``
        instead, and the next claim replaces it with this retry's task, under this retry's own timeout.
        """
        task_id, model, owner, deadline = submission.task_id, submission.model, submission.owner, submission.deadline
        scope = owner or idempotency.ANONYMOUS_SCOPE
        fingerprint = idempotency.fingerprint(submission.input, model)
        unstored: str | None = None  # a bound task still not stored after the grace, at the last claim
        # The deadline is taken at each claim: the claim that binds this retry's task comes just before
        # it is sent, with the deadline it will carry (``publisher``), however long the retry waited.
        while (
            bound := await self._keys.claim(
                scope, key, task_id, fingerprint, self._clock.wall_ms() + submission.timeout_ms
            )
        ).task_id != task_id:
            earlier = bound.earlier
            if earlier is None and bound.task_id != unstored:
                earlier = await self._keys.stored(bound.task_id, UNSTORED_GRACE_S)
                if earlier is None:
                    # Its submit may have been refused meanwhile and released the key: sent now, that
                    # task would be one the key no longer names. The next claim says whether it still does.
                    unstored = bound.task_id
                    continue
            if earlier is None and not await self._resend(submission, bound.claim):
                continue  # ended expired: the next claim replaces it
            if self._admission.active:
                self._admission.count(model, submission.tier, "admitted")  # a replay: no queue work
            if not wait:
                status = TaskStatus.QUEUED if earlier is None else earlier.status
                return Accepted(bound.task_id, model, replayed=True, status=status)
            replayed = self._keys.ended(bound.claim, deadline, submission.timeout_ms)
            # A replay's wait is rare: its caller's connection is watched from the start.
            state = await (
                replayed
                if disconnected is None
                else unless_gone(replayed, disconnected, functools.partial(_runs_on, bound.task_id))
            )
            if state is not None and not (
                idempotency.starts_anew(state) and asyncio.get_running_loop().time() < deadline
            ):
                return answer_of(
                    state, self._clock.monotonic() - submission.started, submission.timeout_ms, replayed=True
                )
            # The task ended without being computed, or went stale, while this retry waited for it:
            # the next claim starts a new one (or finds the one a racing retry started).
        bound_until = asyncio.get_running_loop().time() + submission.timeout_ms / 1000  # as the binding's deadline
        try:
            submission = await self._queued(self._admission if self._admission.active else None, submission, part)
        except Overloaded:
            await self._keys.release(scope, key, task_id, model, owner, bound_until)  # nothing was queued
            raise
        try:
            if wait:
                return await self._answer_when_done(submission, disconnected, keyed=True)
            return await self._enqueue(submission)
        except QueuedUnrecorded:
            raise  # the task may still run: its key stays bound to it
        except Unavailable:
            await self._keys.release(scope, key, task_id, model, owner, bound_until)  # a retry may create it
            raise
        finally:
            if submission.ticket is not None:
                submission.ticket.close()

    async def _resend(self, submission: Submission, claim: KeyClaim) -> bool:
        """Records and sends the bound task ``claim`` names, whose submit ended before it stored it:
        under that task's id and its deadline (when sooner than this retry's), with no reply wanted
        (a caller who waits for it follows the store, as for any replayed task). False when too
        little of its time is left to send it: it was ended ``expired`` instead."""
        timeout_ms = submission.timeout_ms
        if claim.deadline_ms is not None:
            left_ms = claim.deadline_ms - self._clock.wall_ms()
            if left_ms < UNSTORED_GRACE_S * 1000:
                queued, _ = self._publisher.task(replace(submission, task_id=claim.task_id), None)
                # Not stored by now: its submit ended first, or its record outlived the result TTL.
                why = (
                    f"its Idempotency-Key names this task, but no record of it was found by its deadline (its "
                    f"submit ended before storing it, or its result outlived {env_name('result_ttl_s')}); a "
                    "retry with the key starts a new task"
                )
                await self._publisher.end_unsent(queued, max(0, left_ms), message=why)
                return False
            timeout_ms = min(timeout_ms, left_ms)
        deadline = min(submission.deadline, asyncio.get_running_loop().time() + timeout_ms / 1000)
        log.info(
            "sending task %s again: its key is bound to it, but it was never stored",
            claim.task_id,
            extra=ids(task_id=claim.task_id),
        )
        await self._enqueue(replace(submission, task_id=claim.task_id, timeout_ms=timeout_ms, deadline=deadline))
        return True

    async def _submit_shared(
        self,
        key: str,
        submission: Submission,
        wait: bool,
        watch: Disconnected | None,
        part: ClientPart,
    ) -> Answer | Accepted:
        """A deterministic model's request: cached, else shared with identical ones (``SharedAnswers``).

        A cache hit, or a caller that joins an identical computation in flight, adds nothing to its
        model's queue: it is admitted without the queue's checks, which only a request to be queued
        goes through (``Admission.queue``). Its client's part (its rate-limit token, its token count)
        was checked in ``submit``, and is given back if the queue refuses it, as a request refused 503
        takes none (a ``charged`` input's request gives back its own)."""
        admission = self._admission if self._admission.active else None
        model, tier = submission.model, submission.tier
        try:
            if (hit := await self._shared.cached(key, submission, wait=wait)) is not None:
                if tracing.ACTIVE:
                    spans.request_sent(hit.task_id)  # its record is built: the span names the caller's task
                if admission is not None:
                    admission.count(model, tier, "admitted")
                if not wait:
                    return Accepted(hit.task_id, hit.model, status=hit.status)  # completed: no poll needed
                answer = self._answer(hit, submission, shared=True)
            elif wait:
                if (refusal := self._store.refuses_writes()) is not None:  # ``submit`` left it to a cache miss
                    await self._give_back(admission, part)
                    raise Unavailable(refusal)
                if self._shared.joins(key, submission):
                    if admission is not None:
                        admission.count(model, tier, "admitted")
                else:
                    submission = await self._queued(admission, submission, part)
                state = await self._shared.computed(key, submission, watch)
                answer = self._answer(state, submission, shared=True)
            else:
                submission = await self._queued(admission, submission, part)
                return await self._enqueue(submission)
        finally:
            if submission.ticket is not None:
                submission.ticket.close()
        self._admission.count(model, tier, "answered")
        return answer

    @staticmethod
    async def _give_back(admission: Admission | None, part: ClientPart) -> None:
        """Gives back the rate-limit token ``submit`` took for a request refused 503 after it, as one
        refused before takes none (a ``charged`` input's request gives back its own)."""
        if admission is not None and not part.charged:
            await admission.refund(part.caller, 1)

    async def _queued(self, admission: Admission | None, submission: Submission, part: ClientPart) -> Submission:
        """A shared or keyed request that is to be queued after all: the store's room for its input
        (``full``, which ``submit`` left to here), then its place in its model's queue (``Admission.queue``,
        with admission checks); a refusal gives back the rate-limit token ``submit`` took for it."""
        if (full := self._store.full(submission.model)) is not None:
            await self._give_back(admission, part)
            raise Overloaded(full)
        if admission is None:
            return submission
        try:
            ticket = await admission.queue(
                part.caller, submission.model, submission.timeout_ms, submission.tier, part.weight
            )
        except Overloaded:
            await self._give_back(admission, part)
            raise
        return replace(submission, ticket=ticket)

    async def _answer_when_done(
        self, submission: Submission, disconnected: Disconnected | None, *, keyed: bool
    ) -> Answer:
        """Publishes the request and waits for its reply.

        The task's "queued" record is written only where its id can be asked for before the answer:
        with an idempotency key (a retry reads it) or an owner (who may read it, written only at
        create); else its caller learns the id with the answer, and its end is its first write (the
        batcher writes no "batched" for it, and the worker's "running" only checks that it has not
        ended). A 504 and a disconnect, which hand the id out or cancel the task early, write it then.
        Sparing the write takes a Redis command off the common request.
        """
        task_id, timeout_ms, started = submission.task_id, submission.timeout_ms, submission.started
        record = keyed or submission.owner is not None
        publisher = self._publisher
        queued, request = publisher.task(submission, self.settings.gateway_id)
        # Register, then publish: the reply may arrive before ``send`` even returns.
        future = self._replies.register(task_id, started, disconnected)
        published = False
        try:
            async with asyncio.timeout_at(submission.deadline):
                await publisher.publish(queued, request, record=record, ticket=submission.ticket)
                published = True
                state = await future
        except TimeoutError:
            # Only our deadline raises it here: a transport's own TimeoutError (an OSError)
            # became Unavailable inside publish.
            if not published:
                # Ended now, and past its deadline no worker starts it: nothing is left to poll for.
                await publisher.end_unsent(queued, timeout_ms, wait_s=LAST_LOOK_S)
                raise DeadlineExceeded(
                    f"timeout_ms={timeout_ms} passed before the request bus took the request; send a longer "
                    "timeout_ms (the task ended expired, never computed)",
                    task_id=task_id,
                ) from None
            if record:
                ended = await self._replies.stored_end(task_id)
            else:
                # Side by side (a completed task keeps its end over the late "queued"): a store that does
                # not answer holds the 504 for ``LAST_LOOK_S`` at most.
                ended, _ = await asyncio.gather(
                    self._replies.stored_end(task_id), publisher.record_late(queued, wait_s=LAST_LOOK_S)
                )
            if ended is None:
                raise DeadlineExceeded(
                    f"no answer within timeout_ms={timeout_ms}; the task may still finish: poll its result",
                    task_id=task_id,
                ) from None
            state = ended
        except CallerGone:
            if keyed:
                raise _runs_on(task_id) from None
            if not record:
                await publisher.record_late(queued)
            await publisher.cancel_abandoned(task_id)
            raise ClientDisconnected(
                "the caller closed the connection before the answer; its task was cancelled", task_id=task_id
            ) from None
        finally:
            if not future.done():
                future.cancel()  # a watch that ends from now on (the answer was sent) does nothing
            self._replies.discard(task_id)
        return self._answer(state, submission)

    async def _enqueue(self, submission: Submission) -> Accepted:
        task_id, timeout_ms = submission.task_id, submission.timeout_ms
        queued, request = self._publisher.task(submission, None)
        try:
            async with asyncio.timeout_at(submission.deadline):
                await self._publisher.publish(queued, request, record=True, ticket=submission.ticket)
        except TimeoutError:
            # The task's own deadline passed while it was being queued: a deadline, like the
            # synchronous route's, whether the bus was stuck or the deadline was just short.
            await self._publisher.end_unsent(queued, timeout_ms, wait_s=LAST_LOOK_S)
            raise DeadlineExceeded(
                f"timeout_ms={timeout_ms} passed before the task store and the request bus took the request; "
                "send a longer timeout_ms (the task ended expired)",
                task_id=task_id,
            ) from None
        return Accepted(task_id, submission.model)

    def _answer(self, state: TaskState, submission: Submission, *, shared: bool = False) -> Answer:
        """The caller's answer from its task's terminal state; a completed one counts in the latency
        histogram and, unless ``shared`` (its computation counts itself), the admission's service time."""
        latency_s = self._clock.monotonic() - submission.started
        if tracing.ACTIVE:
            spans.request_answered(state.updated_at_ms)
        histogram = self._latency.get(state.model)
        if state.status is TaskStatus.COMPLETED and histogram is not None:
            histogram.observe(latency_s)
            if not shared:
                self._admission.answered(state.model, latency_s)
        return answer_of(state, latency_s, submission.timeout_ms)

    # -- reading (TaskReads) -------------------------------------------------------------------

    async def result(
        self, task_id: str, wait_s: float = 0.0, *, owner: str | None = None, client: str = "-"
    ) -> TaskState:
        """The task's state; with ``wait_s`` > 0, waits up to that long for it to end (see ``TaskReads``)."""
        return await self._reads.result(task_id, wait_s, owner=owner, client=client)

    def events(self, task_id: str, *, owner: str | None = None, client: str = "-") -> AsyncGenerator[TaskState, None]:
        """The task's current state, then each later one until it ends (see ``TaskReads``)."""
        return self._reads.events(task_id, owner=owner, client=client)

    def watching(self, client: str) -> AbstractContextManager[None]:
        """Counts a stream held open for ``client`` (the dashboard's) while inside, against
        ``max_watchers`` and the client's share, as a long-poll and a task's stream count."""
        return self._reads.watching(client)

    async def cancel(self, task_id: str, *, owner: str | None = None) -> TaskState:
        """Cancels a task no worker has started yet (see ``TaskReads``)."""
        return await self._reads.cancel(task_id, owner=owner)


def _runs_on(task_id: str) -> ClientDisconnected:
    return ClientDisconnected(
        "the caller closed the connection before the answer; its task runs on for a retry with the same "
        "Idempotency-Key",
        task_id=task_id,
    )
