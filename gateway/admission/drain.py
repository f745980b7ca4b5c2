"""How long a new request would wait in its model's queue, measured from the queue's own counters.

Admission refuses at once (503 ``overloaded``) a request whose deadline the queue ahead of it
cannot meet, rather than holding it until a 504: under overload the queue then stays only as long
as the deadlines allow, and the GPU computes answers that someone still waits for.

The predicted wait is depth / drain rate. The rate is measured only over intervals in which the
queue stayed non-empty, where the workers, not the arrivals, set the pace (one in which no batch
left measures nothing: a batcher still joining its group is a stall's question); that makes it a lower
bound on the model's capacity, so the meter keeps the highest one, halving it only over
``half_life_s`` of such intervals that measure less: a burst after a quiet spell is not refused for
a rate learned while little queued, and a model that lost workers is seen within seconds.

A model is *stalled* when requests have waited ``settle_s`` and no batch has reached its workers for
``stall_s`` (every worker busy past any normal call, hung or gone): its requests are refused, and
``/readyz`` names it, until a batch is taken again; an empty queue lets one request through every
``stall_s`` as a probe, so a model whose workers came back is seen, and ends the stall at once when
an idle worker is seen waiting for work (``worker_idle``).

Pure: samples come from :class:`~transport.ports.Backlog` (each stamped with when it was
read), so the same code runs over the in-memory counters, Kafka's offsets, and a test's numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transport.ports import Backlog


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
    """One model's drain rate and progress, from successive ``Backlog`` samples."""

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
        self._last: Backlog | None = None
        self._busy_s = 0.0
        self._busy_left = 0
        self._busy_batches = 0
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

    def observe(self, backlog: Backlog, prior_rate_per_s: float | None = None) -> Estimate:
        """Takes a sample (if it is ``sample_every_s`` newer than the last) and predicts the wait, by
        ``prior_rate_per_s`` (the workers' own word, ``gateway.admission.worker_rates``) until a rate is measured.

        A stalled model's empty queue admits one request every ``stall_s``, as a probe: a batch
        taken ends the stall."""
        last = self._last
        if last is None:
            self._last = backlog
            self._batch_at_s = backlog.at_s
        elif backlog.at_s - last.at_s >= self.sample_every_s:
            self._sample(last, backlog)
            self._last = backlog
        if self._waiting_since_s is None and backlog.depth > 0:
            self._waiting_since_s = backlog.at_s
        elif backlog.depth == 0:
            self._waiting_since_s = None
        if self._stalled_at_s is not None:
            if backlog.depth == 0 and backlog.at_s - self._probe_at_s >= self.stall_s:
                self._probe_at_s = backlog.at_s
                return Estimate(0, 0.0, self._rate, backlog.at_s - self._batch_at_s)
            return Estimate(backlog.depth, math.inf, self._rate, backlog.at_s - self._batch_at_s)
        waiting_since = self._waiting_since_s
        if (
            waiting_since is not None
            and backlog.at_s - waiting_since >= self.settle_s
            and backlog.at_s - self._batch_at_s >= self.stall_s
        ):
            self._stalled_at_s = self._probe_at_s = backlog.at_s
            return Estimate(backlog.depth, math.inf, self._rate, backlog.at_s - self._batch_at_s)
        rate = self._rate if self._rate is not None else prior_rate_per_s
        wait_s = backlog.depth / rate if rate and backlog.depth else 0.0
        return Estimate(backlog.depth, wait_s, rate, 0.0)

    def _sample(self, last: Backlog, now: Backlog) -> None:
        if now.batches != last.batches:
            self._batch_at_s = now.at_s
            self._stalled_at_s = None
        elif now.at_s - last.at_s > self.settle_s and self._stalled_at_s is None:
            # No fresh counters for a while (the bus was unreachable): what the workers did meanwhile is
            # unknown, so the wait for a batch starts again rather than counting the outage.
            self._batch_at_s = now.at_s
            self._waiting_since_s = None
        if last.depth > 0 and now.depth > 0:
            self._busy_s += now.at_s - last.at_s
            self._busy_left += max(0, now.left - last.left)
            self._busy_batches += max(0, now.batches - last.batches)
            if self._busy_s >= (self.first_window_s if self._rate is None else self.window_s):
                # Requests leave in whole batches, so a window counts one batch more or less than its
                # span drained, by chance; the highest measure is kept, so one batch is not counted.
                drained = self._busy_left * (1 - 1 / self._busy_batches) if self._busy_batches > 1 else self._busy_left
                if drained > 0:  # none drained (a batcher not consuming yet): a stall's question, not a rate
                    measured = drained / self._busy_s
                    kept = 0.0 if self._rate is None else self._rate * 0.5 ** (self._busy_s / self.half_life_s)
                    self._rate = max(measured, kept)
                self._busy_s, self._busy_left, self._busy_batches = 0.0, 0, 0
