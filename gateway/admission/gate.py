"""Who a caller is, and whether the deployment takes one more request from them right now.

Checked before anything is stored or produced, cheapest first: the request's model's queue (cached
counters, no I/O), then the client's rate limit (one store round trip, only when limits are on), then
the request's own dearer check (its inputs' token count), which gives the rate-limit tokens back if it
refuses: a client over its limit is refused before it costs a count. A request of several inputs (the
OpenAI routes) takes its tokens at once before its inputs' queue checks, and gets them back if those
refuse it (``charge``). So does a request whose answer may be shared (``gateway.sharing``): a cache hit,
or a caller that joins an identical computation in flight, adds nothing to the queue and skips its
checks; only one to be queued goes through them (``queue``). A refusal says what limit was hit and which
setting raises it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from prometheus_client import Counter

from gateway.admission.fair_share import FAIR_AFTER_S, FairShare
from gateway.admission.priority import KeyTiers, request_tier
from gateway.admission.wait import MARGIN, ModelQueue, Prediction
from gateway.errors import GatewayError, Overloaded, PredictedLate, RateLimited, Unavailable, ValidationFailed
from gateway.settings import GatewaySettings, env_name
from gateway.unseen import Ticket, Unseen
from schemas.records import Credit, Priority
from telemetry.metrics import STATED_RATE, TIER_SUBMITS
from transport.background_loop import BackgroundLoop
from transport.ports import Backlog, CreditPool, QueueDepth, RateLimiter, TransportError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request.

    ``owner`` (the API key's owner id, None without API keys) sees only the tasks it created;
    ``client`` (``key:<owner>``, ``id:<X-Client-Id>`` or ``ip:<address>``) is whose rate limit a
    submit counts against.
    """

    owner: str | None = None
    client: str = "-"
    tiers: KeyTiers | None = None
    """The API key's priority tiers (None: normal by default, up to high)."""


ANONYMOUS = Caller()

Check = Callable[[], Awaitable[Sequence[int]]]
"""A request's check that costs more than its rate-limit token (its inputs' token count): run once the
token is taken, so a client over its limit is refused before it costs one; raises a ``GatewayError``,
else returns each input's weight (its tokens) in its client's fair share."""


class Admission:
    """The checks of one submit, cheapest first: its model's queue, then the client's rate limit.

    A model's queue refuses a request when it holds ``max_queue_depth`` requests, or when its answer
    is predicted past the request's deadline (``gateway.admission.wait``, which also says when a
    model is stalled): a refusal now (503 with Retry-After) instead of a 504 later, and no GPU time
    for an answer nobody waits for. The workers' credits are read every ``SAMPLE_EVERY_S``.

    Lower priority tiers are shed first: ``low`` is refused once the queue holds
    ``queue_fraction_low`` of ``max_queue_depth``, ``normal`` past ``queue_fraction_normal``, ``high``
    only at the whole limit.
    """

    def __init__(
        self,
        settings: GatewaySettings,
        queue_depth: QueueDepth | None,
        limiter: RateLimiter | None,
        credits: CreditPool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``credits``: the pool the workers offer credits to, read for their rates
        (``WorkerRates`` in ``gateway.admission.wait``); ``clock``: the one that stamps the queue's counters
        (``Backlog.at_s``)."""
        self.max_queue_depth = settings.max_queue_depth
        self._tier_limits = {
            Priority.HIGH: (settings.max_queue_depth, "max_queue_depth"),
            Priority.NORMAL: (
                math.ceil(settings.max_queue_depth * settings.queue_fraction_normal),
                "queue_fraction_normal",
            ),
            Priority.LOW: (math.ceil(settings.max_queue_depth * settings.queue_fraction_low), "queue_fraction_low"),
        }
        self._fair = FairShare()
        by_tokens = settings.max_batch_tokens > 0  # a token budget bounds batches: shares count tokens
        self._share_unit = "tokens" if by_tokens else "requests"
        """What a fair share counts: a request's tokens weigh it where a token budget counts them."""
        self._clock = clock
        self._counters: dict[tuple[str, Priority, str], Counter] = {}
        self.retry_after_s = settings.retry_after_s
        self.by_wait = settings.admit_by_wait
        self._queue_depth = queue_depth if settings.max_queue_depth > 0 or settings.admit_by_wait else None
        self._limiter = limiter if settings.rate_limit_per_s > 0 else None
        self._queues = {model: ModelQueue(stall_s=settings.stall_s, by_tokens=by_tokens) for model in settings.models}
        self._credits = credits
        self._unseen = {model: Unseen(clock) for model in settings.models}
        self._states: dict[str, str] = {}
        """Each model's state as last logged (``models``)."""
        self._sampler = BackgroundLoop("admission-sampler")
        self.active = self._queue_depth is not None or self._limiter is not None
        """Whether a submit has anything to check here (else the gateway skips the call)."""

    async def start(self) -> None:
        """Samples every model's queue in the background, so a stall shows while no request comes."""
        if self._queue_depth is not None and self.by_wait and not self._sampler.started:
            self._sampler.start(self._sample_forever())

    async def close(self) -> None:
        await self._sampler.close()

    @property
    def alive(self) -> bool:
        """Whether the sampler runs, where it was started: without it a stall shows only while requests
        come, and ends only by a probe."""
        return self._sampler.alive or not self._sampler.started

    async def _sample_forever(self) -> None:
        while True:
            await self.read_worker_rates()
            self.models()
            await asyncio.sleep(SAMPLE_EVERY_S)

    async def read_worker_rates(self) -> None:
        """Reads the rates each model's idle workers state in their credits (the sampler does, at start
        and every ``SAMPLE_EVERY_S``)."""
        credits = self._credits
        if credits is None:
            return
        for model, queue in self._queues.items():
            now_ms = int(time.time() * 1000)
            offered: list[Credit] = []
            # Unread this time, the rates already read stand until their credits expire.
            with contextlib.suppress(TransportError):
                offered = await credits.offered(model)
            queue.read_credits(offered, now_ms)
            if any(credit.expires_at_ms > now_ms for credit in offered) and queue.drain.worker_idle():
                self._state_changed(model, "serving", "an idle worker waits for work and no request waits")
            stated = queue.stated
            STATED_RATE.labels(model=model).set(stated.rate_per_s if stated else 0.0)

    async def admit(
        self,
        caller: Caller,
        model: str,
        timeout_ms: int,
        tier: Priority = Priority.NORMAL,
        *,
        charged: bool = False,
        check: Check | None = None,
        weight: int | None = None,
    ) -> Ticket | None:
        """Returns when the request may go on; raises ``Overloaded``, ``RateLimited`` or ``Unavailable``.
        ``charged``: its rate-limit token was taken with its request's others (``charge``), and
        ``weight`` is its weight that ``charge`` returned; else ``check`` runs once its token is taken
        (``charge``), before it counts as admitted, and returns its weight.

        The ticket (None when no queue is watched) is to be told when the request is ``sent`` and
        ``close``d when its submit ends. Each outcome counts in ``batchwire_tier_submits`` under the
        request's model and tier."""
        try:
            client = await self._check(caller, model, timeout_ms, tier)
            # Its place is taken before the rate limit's round trip and the token count, so the requests
            # checked meanwhile count it: a burst is held against all of itself, not let through whole.
            ticket = self._place(model)
            try:
                if not charged and (weights := await self.charge(caller, 1, check)):
                    weight = weights[0]
            except BaseException:
                if ticket is not None:
                    ticket.close()
                raise
        except Overloaded:
            self.count(model, tier, "refused")
            raise
        self._admitted(model, tier, client, weight)
        return ticket

    async def queue(
        self, caller: Caller, model: str, timeout_ms: int, tier: Priority, weight: int | None = None
    ) -> Ticket | None:
        """The queue's part of ``admit``, for a request whose token ``charge`` took before it was known
        whether its answer needs queue work (a shared answer, ``gateway.sharing``: a cache hit or a
        caller that joins a computation in flight adds nothing to the queue, and is not held against
        it). Raises ``Overloaded``; counts the outcome as ``admit`` does."""
        try:
            client = await self._check(caller, model, timeout_ms, tier)
        except Overloaded:
            self.count(model, tier, "refused")
            raise
        ticket = self._place(model)
        self._admitted(model, tier, client, weight)
        return ticket

    def count(self, model: str, tier: Priority, outcome: str) -> None:
        """One submit of ``model`` at ``tier`` in ``batchwire_tier_submits`` (admitted, refused, answered)."""
        key = (model, tier, outcome)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = TIER_SUBMITS.labels(model=model, priority=tier.value, outcome=outcome)
        counter.inc()

    async def charge(self, caller: Caller, inputs: int, check: Check | None = None) -> Sequence[int] | None:
        """Takes ``inputs`` tokens from the caller's rate limit at once, one per input of its request, so
        a request of several inputs is admitted whole or refused whole; raises ``RateLimited``,
        ``Unavailable``, or ``ValidationFailed`` for more inputs than a burst, or than its tier's queue
        limit (each input admitted counts in its model's queue at once), which no wait admits.
        Then runs ``check``, what refuses the request at more cost than the token (its token count), so
        that a client over its limit never gets that far; a refusal there gives the tokens back.
        Returns the inputs' weights that ``check`` returns (None without one)."""
        limit, setting = self._tier_limits[request_tier(None, caller.tiers)]
        if self._queue_depth is not None and self.max_queue_depth > 0 and inputs > limit:
            raise ValidationFailed(
                f"this request holds {inputs} inputs, more than its model's queue admits at once at its priority "
                f"({limit}: {_limit_of(setting, self.max_queue_depth)}); send at most {limit} per request"
            )
        await self._take(caller, inputs)
        if check is None:
            return None
        try:
            return await check()
        except GatewayError:
            await self.refund(caller, inputs)
            raise

    async def _take(self, caller: Caller, inputs: int) -> None:
        limiter = self._limiter
        if limiter is None:
            return
        if inputs > limiter.burst:
            raise ValidationFailed(
                f"this request holds {inputs} inputs, more than this client's rate limit lets through at once "
                f"({limiter.burst}: {env_name('rate_limit_burst')}); send at most {limiter.burst} per request"
            )
        try:
            wait_s = await limiter.acquire(caller.client, inputs)
        except TransportError as err:
            raise Unavailable(f"the rate limiter's store is unavailable: {err}") from err
        if wait_s > 0:
            raise RateLimited(
                f"this client is over its rate limit of {limiter.rate_per_s:g} requests/s with bursts of "
                f"{limiter.burst} ({env_name('rate_limit_per_s')}, {env_name('rate_limit_burst')}); "
                f"the next {'request is' if inputs == 1 else f'{inputs} inputs are'} accepted in {wait_s:.3f} s",
                retry_after_s=max(1, math.ceil(wait_s)),
            )

    async def refund(self, caller: Caller, inputs: int) -> None:
        """Gives back the ``inputs`` tokens ``charge`` took (best effort: a store that fails keeps them)."""
        if self._limiter is not None:
            with contextlib.suppress(TransportError):
                await self._limiter.acquire(caller.client, -inputs)

    async def _check(self, caller: Caller, model: str, timeout_ms: int, tier: Priority) -> str | None:
        """Raises ``Overloaded`` where the model's queue refuses the request; returns whose fair share
        it counts in (None: none is kept)."""
        queue_depth = self._queue_depth
        # A fair share applies where the predicted wait is checked: only there are rates kept.
        client = _fairness_id(caller) if queue_depth is not None and self.by_wait else None
        if queue_depth is None:
            return client
        backlog = queue_depth.backlog(model)
        if backlog is not None:
            tickets = self._unseen.get(model)
            self._check_queue(
                model, backlog, 0 if tickets is None else tickets.count(backlog.at_s), timeout_ms, tier, client
            )
        elif self.max_queue_depth > 0:
            # the deployment-wide figure, while the model's is unknown; unknown too, nothing is held
            # against the request (a bus that is down fails its send anyway)
            depth = await queue_depth.depth()
            limit, setting = self._tier_limits[tier]
            if depth is not None and depth >= limit:
                raise Overloaded(
                    f"the deployment holds {depth} requests not yet handed to a worker; {tier.value!r} requests "
                    f"are refused from {limit} ({_limit_of(setting, self.max_queue_depth)}); nothing was "
                    "queued: retry after the Retry-After delay"
                )
        return client

    def _place(self, model: str) -> Ticket | None:
        """The request's place among its model's unseen ones (None when no queue is watched)."""
        unseen = self._unseen.get(model)
        return unseen.admitted() if unseen is not None and self._queue_depth is not None else None

    def _admitted(self, model: str, tier: Priority, client: str | None, weight: int | None) -> None:
        queue = self._queues.get(model)
        if queue is not None:
            queue.mix.admitted(tier)
        if client is not None:
            now_s = self._clock()
            for rank in range(tier.rank, len(Priority)):  # it waits ahead of its own tier and every lower one
                self._fair.admitted(_share_lane(model, rank), client, now_s, weight)
        self.count(model, tier, "admitted")

    def answered(self, model: str, latency_s: float) -> None:
        """A synchronous answer's latency: the fastest recent one is the model's service time."""
        queue = self._queues.get(model)
        if queue is not None:
            queue.answered(latency_s)

    def models(self) -> dict[str, str]:
        """Each model's state for ``/readyz``: ``stalled`` while requests wait and its workers take none.

        Each change of a model's state is logged, with why (read here, and by the sampler every
        ``SAMPLE_EVERY_S``)."""
        states: dict[str, str] = {}
        for model, queue in self._queues.items():
            meter = queue.drain
            backlog = self._queue_depth.backlog(model) if self._queue_depth is not None else None
            estimate = meter.observe(backlog, probe=False) if backlog is not None else None
            state = states[model] = "stalled" if meter.stalled else "serving"
            if state != self._states.get(model, "serving"):
                if estimate is not None and state == "stalled":
                    why = (
                        f"{estimate.depth} requests wait and no batch has reached its workers for "
                        f"{estimate.stalled_s:.1f} s; its submits are refused until one does"
                    )
                else:
                    why = "a batch reached its workers"
                self._state_changed(model, state, why)
        return states

    def _state_changed(self, model: str, state: str, why: str) -> None:
        self._states[model] = state
        log.warning("model %r is %s: %s", model, state, why)

    def _check_queue(
        self, model: str, backlog: Backlog, unseen: int, timeout_ms: int, tier: Priority, client: str | None = None
    ) -> None:
        """``unseen``: this gateway's admissions the counters may not hold yet, which wait ahead too."""
        depth = backlog.depth + unseen
        limit, setting = self._tier_limits[tier]
        if self.max_queue_depth > 0 and limit <= depth:
            raise Overloaded(
                f"model {model!r} has {depth} requests waiting for a worker; {tier.value!r} requests are refused "
                f"from {limit} ({_limit_of(setting, self.max_queue_depth)}); nothing was queued: retry after the "
                "Retry-After delay"
            )
        if not self.by_wait:
            return
        queue = self._queues.get(model)
        if queue is None:
            return
        predicted = queue.predict(backlog, tier, unseen)
        if predicted.stalled:
            raise Overloaded(
                f"model {model!r} has {depth} requests waiting and its workers have taken none for "
                f"{predicted.stalled_s:.0f} s (busy past any normal call, hung or gone, unable to reach Redis, or no "
                "batcher reads its requests: their logs and `batchwire status` say which); nothing was queued: retry "
                "after the Retry-After delay"
            )
        if client is not None:
            self._check_share(model, client, predicted, tier)
        timeout_s = timeout_ms / 1000
        if predicted.refuses(timeout_s):
            raise PredictedLate(
                f"model {model!r} has {depth} requests waiting; a {tier.value!r} request's answer is predicted in "
                f"about {predicted.answer_s:.1f} s at the {predicted.rate_per_s or 0:.0f} requests/s it drains; "
                f"timeout_ms={timeout_ms} cannot be met, so nothing was queued: retry after the Retry-After delay, "
                "or send a longer timeout_ms",
                model=model,
                answer_s=predicted.answer_s,
                timeout_ms=timeout_ms,
                retry_after_s=min(MAX_RETRY_AFTER_S, max(1, math.ceil(predicted.answer_s * MARGIN - timeout_s))),
            )

    def _check_share(self, model: str, client: str, predicted: Prediction, tier: Priority) -> None:
        """Past ``FAIR_AFTER_S`` of queued work, a client above its fair share of the drain is refused,
        unless its request fits the next batch: a model whose call is that long queues a batch's worth
        of work past it, and a burst that one batch takes makes no one wait behind it. The share is among
        the clients sending at ``tier`` or above (``_share_lane``): a lower tier's flood never holds a
        higher tier's client to a share."""
        drain = predicted.rate_per_s
        queued_s = predicted.depth / drain if drain else 0.0
        if not drain or queued_s < FAIR_AFTER_S or predicted.fits_next_batch:
            return
        over = self._fair.over_share(_share_lane(model, tier.rank), client, drain, self._clock())
        if over is not None:
            rate, share, clients = over
            unit = self._share_unit
            among = f"among the {clients} clients sending now" if clients > 1 else "as the one client sending now"
            raise Overloaded(
                f"this client sends {rate:.0f} {unit}/s to model {model!r}, above its fair share of "
                f"{share:.0f} {unit}/s {among}; the model drains {drain:.0f} "
                f"requests/s and {queued_s:.1f} s of work is queued; nothing was queued: send less, or retry "
                "after the Retry-After delay"
            )


SAMPLE_EVERY_S = 0.2


def _share_lane(model: str, rank: int) -> str:
    """Whose rates a request of tier ``rank`` shares the model's drain with: batches take higher tiers
    first, so a request waits only behind its own tier and the higher ones, and each admission counts in
    the lane of its tier and of every lower one."""
    return f"{model}\x00{rank}"


def _fairness_id(caller: Caller) -> str | None:
    """Who a fair share is kept for: the API key's owner, else the rate limit's client; None when the
    caller is not told apart (no keys, no rate limits)."""
    if caller.owner is not None:
        return f"key:{caller.owner}"
    return None if caller.client == "-" else caller.client


def _limit_of(setting: str, max_queue_depth: int) -> str:
    """How a tier's queue limit is set, for a refusal's message."""
    if setting == "max_queue_depth":
        return f"{env_name('max_queue_depth')} = {max_queue_depth}"
    return f"{env_name(setting)} of {env_name('max_queue_depth')} = {max_queue_depth}"


MAX_RETRY_AFTER_S = 60
