"""A discrete-event simulation of one model's batcher and workers on a virtual clock.

It drives batchwire's own batching core, not a copy: ``batcher.policy.BatchFormer`` forms and
seals the batches under the ``FlushPolicy`` with this clock injected, and ``batcher.scheduler``
decides what each claimed credit gets (sent at once, held in reserve, or spaced), as it does in the
batcher. Around them it plays what the services do: a worker runs one batch at a time, offers its next
credit ``credit_lead_ms`` before its running call is expected to end (its expected duration a
moving average of its calls, as ``gpu_worker`` keeps it), and claims take the credit that frees
soonest, as the credit pools do. Several batchers split the requests round robin and share the
credits, the longest-waiting claim first. Call latency comes from the curve, scaled per worker
(a slower GPU).
"""

from __future__ import annotations

import dataclasses
import heapq
import inspect
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from batcher.policy import BatchFormer, FlushPolicy, Pending
from batcher.scheduler import Claim, Claimed, Command, DispatchLoop, Hold, Scheduler, Send, Space
from batcher.settings import BatcherSettings
from batchwire.capacity.curve import Curve
from batchwire.capacity.extras import MeasuredExtras
from batchwire.capacity.outcome import BatchRecord, SimOutcome
from gpu_worker.pipeline import HAND_OVER_POLL_S
from gpu_worker.runner import BackendRunner
from gpu_worker.settings import WorkerSettings

MODEL = "model"


def _default(cls: Any, name: str) -> Any:
    """A settings dataclass's default, so the simulation starts from what the services use."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _ewma_alpha() -> float:
    """The worker's moving-average weight for its expected call duration."""
    return float(inspect.signature(BackendRunner).parameters["ewma_alpha"].default)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One deployment of one model: its curve, workers, policy and the service settings that shape dispatch."""

    curve: Curve
    workers: int
    policy: FlushPolicy
    credit_lead_ms: float = _default(WorkerSettings, "credit_lead_ms")
    credit_lead_full_ms: float = _default(WorkerSettings, "credit_lead_full_ms")
    spacing_margin_ms: float = _default(BatcherSettings, "spacing_margin_ms")
    """-1: no spacing. Only a batcher alone with the model's workers spaces them, as in the service."""
    batchers: int = 1
    """Batchers that share the model's requests (round robin) and its workers' credits."""
    transit_ms: float = 0.0
    """A batch's way from the batcher to its worker."""
    overhead_ms: float = 0.0
    """Added to every request's latency: the gateway's and the result's hops."""
    contention_ms: float = 0.0
    """Mean of a further delay drawn per batch from an exponential distribution: the hops' queueing for
    CPU shared with other processes, which delays a whole batch's answers at once (0: none)."""
    seed: int = 0
    """Seed of the contention delays (the arrivals have their own)."""
    worker_scale: tuple[float, ...] = ()
    """Per-worker multiplier of the curve's latency, by worker index (missing: 1): a slower GPU."""
    call_extra_ms: float = 0.0
    """Added to every call whatever its size (its steps' wait for the GIL), drawn per call from an
    exponential distribution with this mean if ``call_extra_spread``."""
    call_extra_spread: bool = False
    call_extras_ms: tuple[tuple[float, float], ...] = ()
    """Measured calls' ``(start, extra)``, the start in seconds from the measured window's, in place of
    ``call_extra_ms``: the calls take them one by one (``batchwire.capacity.extras``), so a stall that
    slowed calls in the run slows the simulated ones at the same time."""
    per_item_ms: float = 0.0
    """Added per answer ahead in its batch: a batch's results are stored and answered one after another."""
    timeout_s: float = math.inf
    """A request's deadline after its arrival (inf: none)."""
    max_backlog: int = 0
    """Stop, reporting unstable, once this many requests are held (0: 50 full batches per worker)."""
    record: bool = False
    """Keep every batch's record (tests check the invariants on them)."""

    def __post_init__(self) -> None:
        if self.workers < 1 or self.batchers < 1:
            raise ValueError(f"workers and batchers must be at least 1, got {self.workers} and {self.batchers}")
        if min(self.contention_ms, self.overhead_ms, self.call_extra_ms) < 0:
            raise ValueError(f"overhead, contention and call extra must be >= 0 ms, got {self}")
        if len(self.worker_scale) > self.workers or any(scale <= 0 for scale in self.worker_scale):
            raise ValueError(f"worker_scale takes at most one positive factor per worker, got {self.worker_scale}")

    def scale(self, worker: int) -> float:
        """Worker ``worker``'s latency multiplier."""
        return self.worker_scale[worker] if worker < len(self.worker_scale) else 1.0

    @property
    def backlog_limit(self) -> int:
        return self.max_backlog or max(10_000, 50 * self.workers * self.batch_limit)

    @property
    def batch_limit(self) -> int:
        """The largest batch a worker runs: the policy's, cut by the backend's (the curve's largest size)."""
        return min(self.policy.max_batch, self.curve.max_batch)


class _Event(IntEnum):
    OFFER = 0
    TIMER = 1
    WAIT_END = 2


Credit = tuple[float, int, int]
"""An offered credit: (when its worker frees, sequence, worker)."""


class _Batcher:
    """One batcher: its accumulators, and its dispatch loop (``batcher.scheduler.DispatchLoop``)."""

    __slots__ = ("former", "index", "loop", "scheduler", "timer_at", "token", "waiting")

    def __init__(self, index: int, scheduler: Scheduler[int]) -> None:
        self.index = index
        self.former = scheduler.former
        self.scheduler = scheduler
        self.loop = DispatchLoop[Credit](scheduler, MODEL)
        self.waiting: Hold | Space | None = None
        """The hold or spacing whose end is scheduled."""
        self.token = 0
        """Counts its waits: a wait's end event that carries an older count is stale."""
        self.timer_at: float | None = None


@dataclass(slots=True)
class _Worker:
    free_s: float = 0.0
    """When its last accepted call ends."""
    expected_s: float | None = None
    """Its moving average of call durations (``BackendRunner.expected_s``)."""
    credit_busy_s: float = 0.0
    """The expected duration its next credit reports (``Credit.busy_ms``)."""


class Simulation:
    """Runs arrivals through the batchers' dispatch and the workers, all on one virtual clock."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.now = 0.0
        margin_s = config.spacing_margin_ms / 1000.0 if config.spacing_margin_ms >= 0 else None
        self.batchers = []
        for i in range(config.batchers):
            former = BatchFormer[int](config.policy, self.clock)
            self.batchers.append(_Batcher(i, Scheduler(former, self.clock, margin_s)))
        self.workers = [_Worker() for _ in range(config.workers)]
        self._alpha = _ewma_alpha()
        base_s = [0.0] + [config.curve.latency_ms(size) / 1000.0 for size in range(1, config.curve.max_batch + 1)]
        extra_s = 0.0 if config.call_extra_spread or config.call_extras_ms else config.call_extra_ms / 1000.0
        self._call_s = [[t * config.scale(w) + extra_s * (t > 0) for t in base_s] for w in range(config.workers)]
        """Call duration by worker and batch size, looked up once."""
        self._events: list[tuple[float, int, int, int, int]] = []
        self._pool: list[Credit] = []
        """Offered credits nobody waits for; a claim takes the soonest to free."""
        self._seq = 0
        self._held = 0
        self._out = SimOutcome(0, 0.0)
        self._rng = random.Random(config.seed)
        self._extras = MeasuredExtras(config.call_extras_ms, self._rng) if config.call_extras_ms else None
        self._due: Sequence[float] = ()
        """When each request was due, by its index (its arrival unless a run says otherwise)."""

    def clock(self) -> float:
        return self.now

    # the loop -------------------------------------------------------------------------------------
    def run(
        self, arrivals: Sequence[float], due: Sequence[float] | None = None, counted_from: float = -math.inf
    ) -> SimOutcome:
        """Feeds ``arrivals`` (ascending seconds) and runs until every request is served. With ``due``
        (one per arrival), a latency counts from the request's due time: a generator's lag counts, as in
        ``batchwire bench``. Requests due before ``counted_from`` (a warm-up) keep no latency."""
        if due is not None and len(due) != len(arrivals):
            raise ValueError(f"due needs one time per arrival, got {len(due)} for {len(arrivals)}")
        self._due, self._counted_from = (due if due is not None else arrivals), counted_from
        out = self._out = SimOutcome(len(arrivals), arrivals[-1] if arrivals else 0.0)
        for index in range(len(self.workers)):
            self._push(0.0, _Event.OFFER, index)
        events, limit, count, i = self._events, self.config.backlog_limit, len(arrivals), 0
        while i < count or (self._held and events):
            if events and (i >= count or events[0][0] <= arrivals[i]):
                at, _, kind, arg, token = heapq.heappop(events)
                self.now = at
                self._on_event(kind, arg, token)
                continue
            self.now = arrivals[i]
            self._arrive(i)
            i += 1
            out.queue_sum += self._held
            if self._held > out.queue_max:
                out.queue_max = self._held
                if self._held > limit:
                    out.stopped_s = self.now
                    out.arrivals = i
                    break
        return out

    def _push(self, at: float, kind: _Event, arg: int, token: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, self._seq, kind, arg, token))

    def _on_event(self, kind: int, arg: int, token: int) -> None:
        if kind == _Event.OFFER:
            self._offered(arg)
            return
        b = self.batchers[arg]
        if kind == _Event.TIMER:
            if b.timer_at == self.now:
                b.timer_at = None
                self._tick(b)
        elif token == b.token:
            self._run(b, b.loop.woke())

    # the batcher's side -----------------------------------------------------------------------------
    def _arrive(self, index: int) -> None:
        now = self.now
        b = self.batchers[index % len(self.batchers)]
        b.former.add(MODEL, Pending(index, 0, index, now, now + self.config.timeout_s))
        self._held += 1
        if b.timer_at is None:
            self._schedule_timer(b)
        self._run(b, b.loop.poke())

    def _schedule_timer(self, b: _Batcher) -> None:
        due = b.former.next_due_s()
        if due is not None and due != math.inf:
            b.timer_at = max(due, self.now)
            self._push(b.timer_at, _Event.TIMER, b.index)

    def _tick(self, b: _Batcher) -> None:
        """As the batcher's timer: a sealed batch wakes the loop (a claim also learns when all it waited
        for expired)."""
        sealed = MODEL in b.former.tick()
        expired = b.former.expire()
        self._held -= len(expired)
        self._out.expired += len(expired)
        self._schedule_timer(b)
        if sealed or (b.loop.claiming and not b.loop.holding):
            self._run(b, b.loop.poke())

    def _offered(self, worker: int) -> None:
        self._seq += 1
        self._give((max(self.workers[worker].free_s, self.now), self._seq, worker))

    def _give(self, credit: Credit) -> None:
        """A credit goes to the claim that has waited longest, or to the pool when none waits."""
        waiting = [b for b in self.batchers if b.loop.claiming]
        if not waiting:
            heapq.heappush(self._pool, credit)
            return
        b = min(waiting, key=lambda b: b.loop.since_s)
        if b.loop.holding:
            self._run(b, b.loop.second(credit, self._claimed(credit)))
            return
        heapq.heappush(self._pool, credit)
        self._run(b, b.loop.poke())

    def _run(self, b: _Batcher, command: Command[Credit]) -> None:
        """Carries out ``b``'s dispatch-loop commands until it waits: for a credit, the end of a hold or
        of spacing, or a ready batch. A claim takes the offered credit that frees soonest."""
        while True:
            if isinstance(command, Claim):
                if not self._pool:
                    return  # ``_give`` hands it the next credit offered
                credit = heapq.heappop(self._pool)
                command = b.loop.claimed(credit, self._claimed(credit), alone=len(self.batchers) == 1)
            elif isinstance(command, Hold) and self._pool:  # the second claim succeeds at once
                credit = heapq.heappop(self._pool)
                command = b.loop.second(credit, self._claimed(credit))
            elif isinstance(command, Hold | Space):
                if command is not b.waiting:  # a wait goes on as it was
                    b.waiting, b.token = command, b.token + 1
                    self._push(command.until_s, _Event.WAIT_END, b.index, b.token)
                return
            elif isinstance(command, Send):
                b.waiting, b.token = None, b.token + 1
                self._send(b, command.credit)
                if command.back is not None:
                    self._give(command.back)
                b.loop.sent()
                command = b.loop.poke()
            else:
                return

    def _claimed(self, credit: Credit) -> Claimed:
        frees_s, _, worker = credit
        return Claimed(str(worker), frees_s, self.workers[worker].credit_busy_s)

    # the worker's side ------------------------------------------------------------------------------
    def _send(self, b: _Batcher, credit: Credit) -> None:
        """Hands one batch to the credit's worker, runs it when the worker is free, schedules its next credit."""
        index = credit[2]
        taken = b.former.take(MODEL, self.config.curve.max_batch)
        self._held -= len(taken.items) + len(taken.expired)
        self._out.expired += len(taken.expired)
        if not taken.items:
            self._give(credit)
            return
        worker, config, out, now = self.workers[index], self.config, self._out, self.now
        size = len(taken.items)
        start_s = max(now + config.transit_ms / 1000.0, worker.free_s)
        call_s = self._call_s[index][size]
        if self._extras is not None:
            window_s = self._counted_from if math.isfinite(self._counted_from) else 0.0
            call_s = max(0.0, call_s + self._extras.take(start_s - window_s))
        elif config.call_extra_spread and config.call_extra_ms > 0:
            call_s += self._rng.expovariate(1000.0 / config.call_extra_ms)
        end_s = start_s + call_s
        b.scheduler.sent(MODEL, self._claimed(credit))
        offer_s = self._offer_at(worker, start_s, end_s, size)
        self._push(offer_s, _Event.OFFER, index)
        before = worker.expected_s
        worker.expected_s = call_s if before is None else before + self._alpha * (call_s - before)
        worker.credit_busy_s = before if before is not None and offer_s < end_s else worker.expected_s
        worker.free_s = end_s
        done_s = end_s + config.overhead_ms / 1000.0
        if config.contention_ms > 0:
            done_s += self._rng.expovariate(1000.0 / config.contention_ms)
        due, step_s, first = self._due, config.per_item_ms / 1000.0, self._counted_from
        out.latencies_s.extend(
            done_s + step_s * k - d for k, p in enumerate(taken.items, 1) if (d := due[p.item]) >= first
        )
        out.ends_s.append(end_s)
        out.sizes.append(size)
        out.batches += 1
        out.busy_s += call_s
        out.last_end_s = max(out.last_end_s, end_s)
        if config.record:
            out.records.append(BatchRecord(index, now, start_s, end_s, tuple(p.item for p in taken.items)))

    def _offer_at(self, worker: _Worker, start_s: float, end_s: float, size: int) -> float:
        """When the worker offers its next credit: ``lead`` before this call's expected end
        (``gpu_worker.credits``), but not before the worker has seen the call start, which it looks for
        every ``HAND_OVER_POLL_S`` (``gpu_worker.pipeline``), and at the latest when the call ends."""
        if worker.expected_s is None:
            return end_s
        full = 2 * size >= self.config.curve.max_batch
        lead_s = (self.config.credit_lead_full_ms if full else self.config.credit_lead_ms) / 1000.0
        if lead_s <= 0:
            return end_s
        return min(end_s, max(start_s + HAND_OVER_POLL_S, start_s + worker.expected_s - lead_s))
