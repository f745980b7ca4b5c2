"""When a request of a model and tier would get its answer: admission's one estimate.

A request is admitted when its answer is predicted within its deadline. The prediction is the work
ahead of it divided by its model's drain, plus two calls:

    answer_s = ahead / drain + 2 * call_s

- **ahead**: the model's queued requests (its counters, ``transport.ports.Backlog``), plus those this
  gateway admitted that the counters' latest read may not hold yet (``gateway.unseen``), times the
  share of recent admissions at the request's tier or above (batches take higher tiers first,
  ``batcher.tiers``).
- **drain**: requests/s, measured from the counters over spans in which the queue stayed non-empty
  (the workers, not the arrivals, set the pace there), and raised to what it drained while it kept
  up; until measured, the sum of what the model's idle workers state in their credits (inputs per
  call over their recent call time; for a worker that has finished no call yet, over the model's
  fastest answer).
- **call_s**: one call and its hops: the fastest recent answer, else the workers' stated call time.
  One call is the request's own; the other is the call that may be running when its turn comes,
  since the queue drains in whole batches.

A request that fits the next batch (``ahead / drain`` under one call) is always admitted: a deadline
too short for any call expires (504, never computed), as on an empty queue. A *stalled* model
(requests waited and no batch reached its workers for ``stall_s``) predicts no answer at all.

Pure: samples, credits and answers come in as values, stamped by the caller's clock, so the same code
runs over the in-memory counters, Kafka's offsets and a test's numbers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from schemas.records import Credit, Priority
from transport.ports import Backlog

MARGIN = 1.1
"""Predicted answer times are stretched this much before they are held against a deadline: the
drain is measured, and a request admitted at the edge would more often expire than be answered."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """What a request of one tier arriving now would meet, and when it would be answered."""

    depth: int
    """Requests queued for the model (all tiers), by the counters and this gateway's unseen admissions."""
    ahead_s: float
    """Time until the request's turn: the work ahead of it over the drain (0 while no drain is known)."""
    call_s: float
    """One call and its hops (0 while unknown)."""
    rate_per_s: float | None
    """The drain the prediction uses (None: neither measured nor stated by the workers)."""
    stalled_s: float
    """How long no batch has reached a worker, once the model is stalled (0: it is not)."""

    @property
    def stalled(self) -> bool:
        """No batch reached the model's workers for ``stall_s`` while requests waited: no answer is predicted."""
        return self.ahead_s == math.inf

    @property
    def answer_s(self) -> float:
        """When the request would be answered (inf: the model is stalled)."""
        return self.ahead_s + 2 * self.call_s

    @property
    def fits_next_batch(self) -> bool:
        """Less than a call's work is ahead of the request: the workers' next batches take it."""
        return self.ahead_s < self.call_s

    def refuses(self, timeout_s: float) -> bool:
        """Whether a request with this deadline is predicted to be answered too late. One that fits
        the next batch never is."""
        return not self.fits_next_batch and self.answer_s * MARGIN > timeout_s


class ModelQueue:
    """One model's queue as admission sees it: its drain, its workers' word, its recent tier mix and
    its fastest answer, combined into one ``Prediction``."""

    def __init__(
        self,
        *,
        stall_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        by_tokens: bool = False,
    ) -> None:
        """``wall_ms``: the wall clock credits expire by, read only while a worker's call time is unknown.
        ``by_tokens``: batches are bounded by a token budget, so how many requests fill one is not known
        (the drain is measured whenever requests wait)."""
        self._wall_ms = wall_ms
        self._by_tokens = by_tokens
        self.drain = DrainMeter(stall_s=stall_s)
        self.workers = WorkerRates()
        self.mix = TierMix()
        self.service = ServiceTime(clock=clock)
        self.stated: Stated | None = None
        """What the model's workers state, as last read from the credit pool."""

    def read_credits(self, credits: Iterable[Credit], now_ms: int) -> None:
        self.workers.seen(credits)
        self._state(self.workers.stated(now_ms, self.service.seconds))

    def answered(self, latency_s: float) -> None:
        """A synchronous answer's latency. The model's first one gives a call time to the workers that
        have not stated theirs yet, so a cold model's first burst is held against a rate within one
        call, not after its drain is measured."""
        known = self.service.seconds
        self.service.observe(latency_s)
        if self.stated is None or not known:  # rarely: the clock is read only then
            self._state(self.workers.stated(self._wall_ms(), self.service.seconds))

    def _state(self, stated: Stated | None) -> None:
        self.stated = stated
        self.drain.full_batch = stated.full_batch if stated is not None and not self._by_tokens else 1

    def predict(self, backlog: Backlog, tier: Priority, unseen: int = 0) -> Prediction:
        """``backlog``: the counters; ``unseen``: this gateway's admissions they may not hold yet."""
        stated = self.stated
        estimate = self.drain.observe(backlog, stated.rate_per_s if stated else None, unseen=unseen)
        call_s = self.service.seconds or (stated.call_s if stated else 0.0)
        return Prediction(
            estimate.depth,
            estimate.wait_s * self.mix.ahead(tier),
            call_s,
            estimate.rate_per_s,
            estimate.stalled_s,
        )


@dataclass(frozen=True, slots=True)
class Estimate:
    """What a request arriving now would meet in its model's queue."""

    depth: int
    wait_s: float
    """Predicted time in the queue: 0 when it is empty or its drain rate is not known yet."""
    rate_per_s: float | None
    """The drain rate the prediction uses (None: neither measured nor told by the workers)."""
    stalled_s: float
    """How long no batch has reached a worker, once the model is stalled (0: it is not)."""


class DrainMeter:
    """One model's drain rate and progress, from successive ``Backlog`` samples.

    The rate is measured only over spans in which the queue held a full batch (``full_batch``, the
    smallest its workers take; 1 while unknown, or where a token budget bounds batches) at both reads:
    a queue shorter than that drains as fast as requests come (one client sending one request at a
    time, read through counters that lag, looks non-empty from read to read), which says nothing of
    the workers. A full batch is also at least the mean batch taken over the last window
    (``window_s``; ``first_window_s`` until a batch is seen, and no span is busy before): a worker that
    takes all that waits each time it frees, its batch unknown (its credit claimed before any read of
    the pool, or a token budget bounding batches), leaves a queue that only gathers arrivals between
    two batches: read as full, that queue would measure a fraction of the arrivals, below a lone
    client's own rate, which its fair share would then cut down further. A span in which no batch
    left measures nothing (a batcher still joining its group is a stall's question). That makes it a
    lower bound on the model's capacity, so the meter keeps the highest, halving it only over
    ``half_life_s`` of spans that measure less: a burst after a quiet spell is not refused for a rate
    learned while little queued, and a model that lost workers is seen within seconds. What a queue
    shorter than that drains is a lower bound too, so a window of such spans raises a measured rate
    to its own (and never lowers it): a rate measured while the batchers could not commit (their
    group's coordinator moving) does not stand once the queue keeps up again, where no busy window
    would come to correct it and every queue of a few dozen would be predicted to wait past its deadline.

    A model is *stalled* when requests have waited ``settle_s`` and no batch has reached its workers
    for ``stall_s`` (every worker busy past any normal call, hung or gone, or no batcher reading its
    requests): its requests are refused, and ``/readyz`` names it, until a batch is taken again. An
    empty queue lets one request through every ``stall_s`` as a probe, and a stall ends at once when an
    idle worker is seen waiting (``worker_idle``).
    """

    def __init__(
        self,
        *,
        first_window_s: float = 0.5,
        window_s: float = 2.0,
        half_life_s: float = 10.0,
        stall_s: float = 5.0,
        settle_s: float = 1.0,
        sample_every_s: float = 0.05,
    ) -> None:
        self.first_window_s = first_window_s
        """The first measurement's span: a model's first burst is admitted by its rate this soon."""
        self.window_s = window_s
        """Later measurements' span. Requests leave in whole batches, so a short window counts one
        batch more or less by chance; the highest of such counts, kept, would predict waits too short."""
        self.half_life_s = half_life_s
        self.stall_s = stall_s
        self.settle_s = settle_s
        """Requests must have waited this long with no batch before a stall is declared: a model idle
        for an hour is not stalled the moment its next request arrives."""
        self.sample_every_s = sample_every_s
        self.full_batch = 1
        """The fewest waiting requests that keep a worker's next batch full (``ModelQueue`` sets it)."""
        self._last: Backlog | None = None
        self._busy = _Span()
        """Spans in which the queue held a full batch: they measure the rate, higher or lower."""
        self._kept_up = _Span()
        """Spans in which it did not: the queue kept up, so the model drained at least what left then."""
        self._taken = _Span()
        """Every span, for the mean batch taken."""
        self._mean_batch = 0.0
        """The mean batch taken over the last ``window_s`` (0: none was)."""
        self._rate: float | None = None
        self._batch_at_s = 0.0
        self._waiting_since_s: float | None = None
        self._stalled_at_s: float | None = None
        self._probe_at_s = 0.0

    @property
    def stalled(self) -> bool:
        """Requests waited while no batch reached a worker for ``stall_s``, and none has since."""
        return self._stalled_at_s is not None

    def worker_idle(self) -> bool:
        """An idle worker waits for work now (its credit lies unclaimed in the pool). A stall with no
        request waiting then ends at once rather than at the next probe: whatever held the model (its
        workers gone or busy, or counters misread) is over. Returns whether it ended a stall."""
        last = self._last
        if self._stalled_at_s is None or last is None or last.depth > 0:
            return False
        self._stalled_at_s = None
        self._batch_at_s = last.at_s  # a new stall needs stall_s without a batch again
        return True

    def observe(
        self, backlog: Backlog, prior_rate_per_s: float | None = None, *, unseen: int = 0, probe: bool = True
    ) -> Estimate:
        """Takes a sample (if it is ``sample_every_s`` newer than the last) and predicts the wait, by
        ``prior_rate_per_s`` (the workers' own word, ``WorkerRates``) until a rate is measured.

        ``unseen``: requests admitted that the counters may not hold yet. They wait ahead of the next
        one, but the samples are the counters' alone: requests slow to reach the bus are none the
        workers could take, so they neither stall the model nor measure its drain.

        A stalled model's empty queue admits one request every ``stall_s``, as a probe: a batch
        taken ends the stall. Only a request takes it: ``probe`` is False for a look at the model's
        state (the sampler's), which would otherwise spend it before a request came."""
        last = self._last
        if last is None:
            self._last = backlog
            self._batch_at_s = backlog.at_s
        elif backlog.at_s - last.at_s >= self.sample_every_s:
            self._sample(last, backlog)
            # ``left`` only grows: a read below the last (a committed offset read as -1 counts its
            # partition from its log's start) is a misread, and the next read's return drained nothing.
            self._last = backlog if backlog.left >= last.left else replace(backlog, left=last.left)
        if self._waiting_since_s is None and backlog.depth > 0:
            self._waiting_since_s = backlog.at_s
        elif backlog.depth == 0:
            self._waiting_since_s = None
        if self._stalled_at_s is not None:
            if probe and backlog.depth == 0 and backlog.at_s - self._probe_at_s >= self.stall_s:
                self._probe_at_s = backlog.at_s
                return Estimate(0, 0.0, self._rate, backlog.at_s - self._batch_at_s)
            return Estimate(backlog.depth + unseen, math.inf, self._rate, backlog.at_s - self._batch_at_s)
        waiting_since = self._waiting_since_s
        if (
            waiting_since is not None
            and backlog.at_s - waiting_since >= self.settle_s
            and backlog.at_s - self._batch_at_s >= self.stall_s
        ):
            self._stalled_at_s = self._probe_at_s = backlog.at_s
            return Estimate(backlog.depth + unseen, math.inf, self._rate, backlog.at_s - self._batch_at_s)
        rate = self._rate if self._rate is not None else prior_rate_per_s
        depth = backlog.depth + unseen
        wait_s = depth / rate if rate and depth else 0.0
        return Estimate(depth, wait_s, rate, 0.0)

    def _sample(self, last: Backlog, now: Backlog) -> None:
        if now.batches != last.batches:
            self._batch_at_s = now.at_s
            self._stalled_at_s = None
        elif now.at_s - last.at_s > self.settle_s and self._stalled_at_s is None:
            # No fresh counters for a while (the bus was unreachable): what the workers did meanwhile is
            # unknown, so the wait for a batch starts again rather than counting the outage.
            self._batch_at_s = now.at_s
            self._waiting_since_s = None
        taken = self._taken
        taken.add(last, now)
        if taken.seconds >= (self.window_s if self._mean_batch else self.first_window_s):
            self._mean_batch = taken.take_batch()
        if self._mean_batch and min(last.depth, now.depth) >= max(self.full_batch, self._mean_batch):
            busy = self._busy
            busy.add(last, now)
            if busy.seconds >= (self.first_window_s if self._rate is None else self.window_s):
                span_s, measured = busy.seconds, busy.take()
                if measured > 0:  # none drained (a batcher not consuming yet): a stall's question, not a rate
                    kept = 0.0 if self._rate is None else self._rate * 0.5 ** (span_s / self.half_life_s)
                    self._rate = max(measured, kept)
        elif self._rate is not None:
            kept_up = self._kept_up
            kept_up.add(last, now)
            if kept_up.seconds >= self.window_s:
                self._rate = max(self._rate, kept_up.take())


@dataclass(slots=True)
class _Span:
    """Counters' growth summed over samples until a window's worth is taken."""

    seconds: float = 0.0
    left: int = 0
    batches: int = 0

    def add(self, last: Backlog, now: Backlog) -> None:
        self.seconds += now.at_s - last.at_s
        self.left += max(0, now.left - last.left)
        self.batches += max(0, now.batches - last.batches)

    def take(self) -> float:
        """The requests/s drained, and a fresh start. Requests leave in whole batches, so a window counts
        one batch more or less than its span drained, by chance; the meter keeps the highest measure,
        so one batch is not counted."""
        drained = self.left * (1 - 1 / self.batches) if self.batches > 1 else self.left
        rate = drained / self.seconds
        self.seconds, self.left, self.batches = 0.0, 0, 0
        return rate

    def take_batch(self) -> float:
        """The mean batch that left (0: none did), and a fresh start."""
        batch = self.left / self.batches if self.batches else 0.0
        self.seconds, self.left, self.batches = 0.0, 0, 0
        return batch


@dataclass(frozen=True, slots=True)
class Stated:
    """What a model's live workers say of themselves, summed or bounded over them."""

    rate_per_s: float
    """Requests/s they take together in full batches at their recent call times."""
    call_s: float
    """The longest of their recent call times: the least an answer takes, while none is measured."""
    full_batch: int
    """The smallest of their largest batches: a queue this deep keeps any of them busy with a full one."""


class WorkerRates:
    """The latest credit of each of one model's workers, as the gateway reads them from the pool.

    A credit shows only while it waits unclaimed, so each worker's latest one is kept until it
    expires (a gone worker's does)."""

    def __init__(self) -> None:
        self._latest: dict[str, Credit] = {}

    def seen(self, credits: Iterable[Credit]) -> None:
        latest = self._latest
        for credit in credits:
            known = latest.get(credit.worker_id)
            if known is None or credit.issued_at_ms >= known.issued_at_ms:
                latest[credit.worker_id] = credit

    def stated(self, now_ms: int, answer_s: float = 0.0) -> Stated | None:
        """None while a live worker's rate is unknown: a partial sum would refuse what the model can
        answer. A worker that has not stated its call time yet (before its first call) is taken at
        ``answer_s``, the fastest answer seen (0: unknown)."""
        latest = self._latest
        for worker, credit in list(latest.items()):
            if credit.expires_at_ms <= now_ms:
                del latest[worker]
        calls_s = [credit.busy_ms / 1000 if credit.busy_ms > 0 else answer_s for credit in latest.values()]
        if not calls_s or min(calls_s) <= 0 or any(credit.max_batch <= 0 for credit in latest.values()):
            return None
        rate = sum(credit.max_batch / call_s for credit, call_s in zip(latest.values(), calls_s, strict=True))
        return Stated(rate, max(calls_s), min(credit.max_batch for credit in latest.values()))


WINDOW = 1000
"""Admissions after which older ones count half: the mix follows a change within a few windows."""


class TierMix:
    """Decayed counts of one model's admitted requests by tier: which share of its queue waits ahead
    of a request of each tier."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._counts = [0.0] * len(Priority)

    def admitted(self, tier: Priority) -> None:
        counts = self._counts
        counts[tier.rank] += 1
        if sum(counts) >= 2 * self.window:
            counts[:] = [count / 2 for count in counts]

    def ahead(self, tier: Priority) -> float:
        """The share (0..1] of the queue a request of ``tier`` waits behind; 1 while unknown."""
        counts = self._counts
        total = sum(counts)
        if total == 0:
            return 1.0
        return max(sum(counts[: tier.rank + 1]) / total, 1 / self.window)


class ServiceTime:
    """The fastest answer in the last one or two windows of ``window_s``: a model's call plus the
    hops, without queueing (a request that found an idle worker). Windows forget a slower past."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._started_s = clock()
        self._current = math.inf
        self._previous = math.inf

    @property
    def seconds(self) -> float:
        fastest = min(self._current, self._previous)
        return 0.0 if fastest == math.inf else fastest

    def observe(self, latency_s: float) -> None:
        now = self._clock()
        if now - self._started_s >= self.window_s:
            self._previous, self._current, self._started_s = self._current, math.inf, now
        if latency_s < self._current:
            self._current = latency_s
