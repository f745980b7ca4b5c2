"""The flush policy and the per-model accumulators: pure code over an injected clock.

Nothing here touches Kafka, Redis or asyncio. The batcher service feeds ``BatchFormer`` with
requests and credits; the same object decides in embedded mode, over Kafka, and under a fake clock
in tests.

Two policies share one mechanism:

* **work-conserving** (default): whenever a worker is idle, whatever is pending goes at once;
  batches grow only while every worker is busy. Size (``max_batch``) and age (``max_wait_ms``) seal
  a batch too, so that no batch exceeds the backend's limit and nothing waits unboundedly.
* **classic**: the fixed "flush at ``max_batch`` items or ``max_wait_ms``" rule many servers use,
  kept so the benchmark can compare both. An idle worker does not trigger a flush.

A *sealed* batch waits for a credit (an idle worker) in FIFO order; items that pass their
deadline before they are handed over come back as expired, never sent to a GPU.

While a model holds items of more than one priority tier, a credit's batch is chosen across
everything it could take (sealed batches, and pending items when work-conserving): higher tiers
first, FIFO within a tier, with each lower tier's earned share (``batcher.tiers``).

With a token budget (``max_batch_tokens``), a batch's padded size (items x its longest input, in
tokens) stays within the budget: a backend pads every input to the longest, so its cost and memory
go with the padded size, not the count. The batch starts with the most urgent item (highest tier,
earliest deadline: nothing starves, and deadlines come before the budget), then takes the items
whose lengths are closest to it, so that little of a batch is padding (``within_budget``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

from batcher.tiers import DEFAULT_MIN_SHARE, TierShares, ranks_waiting

Item = TypeVar("Item")


class FlushReason(StrEnum):
    FULL = "full"
    IDLE_WORKER = "idle_worker"
    MAX_WAIT = "max_wait"
    DEADLINE = "deadline"


class PolicyName(StrEnum):
    WORK_CONSERVING = "work-conserving"
    CLASSIC = "classic"


@dataclass(frozen=True, slots=True)
class FlushPolicy:
    name: PolicyName = PolicyName.WORK_CONSERVING
    max_batch: int = 100
    max_wait_ms: float = 1000.0
    flush_on_idle_worker: bool = True
    deadline_margin_ms: float = 0.0
    """Seal early when the most urgent pending item has less than this left (0 disables)."""
    reserve_ms: float = 0.0
    """Low-load reserve (0 disables): see ``BatchFormer.reserve_s``."""
    reserve_max_load: float = 3.0
    """The reserve applies only while fewer than this many requests arrive per backend call."""
    fresh_ms: float = 3.0
    """A worker found within this long of the newest arrival (or of the claim's start) means the items
    did not wait for one: it covers the claim's round trip to the credit pool."""
    max_batch_tokens: int = 0
    """A batch's padded tokens (items x its longest input) at most this (0: count only)."""

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch} (BATCHWIRE_MAX_BATCH)")
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms} (BATCHWIRE_MAX_WAIT_MS)")
        if not 0 <= self.reserve_ms <= 10_000:
            raise ValueError(f"reserve_ms must be within 0..10000, got {self.reserve_ms} (BATCHWIRE_RESERVE_MS)")
        if self.max_batch_tokens < 0:
            raise ValueError(
                f"max_batch_tokens must be >= 0, got {self.max_batch_tokens} "
                "(BATCHWIRE_MAX_BATCH_TOKENS; 0: count only)"
            )

    @classmethod
    def work_conserving(
        cls, max_batch: int = 100, max_wait_ms: float = 1000.0, reserve_ms: float = 50.0
    ) -> FlushPolicy:
        return cls(PolicyName.WORK_CONSERVING, max_batch, max_wait_ms, flush_on_idle_worker=True, reserve_ms=reserve_ms)

    @classmethod
    def classic(cls, max_batch: int = 32, max_wait_ms: float = 50.0) -> FlushPolicy:
        return cls(PolicyName.CLASSIC, max_batch, max_wait_ms, flush_on_idle_worker=False)

    @classmethod
    def named(
        cls,
        name: str,
        max_batch: int | None = None,
        max_wait_ms: float | None = None,
        reserve_ms: float | None = None,
        max_batch_tokens: int = 0,
    ) -> FlushPolicy:
        policy = PolicyName(name)
        base = cls.work_conserving() if policy is PolicyName.WORK_CONSERVING else cls.classic()
        return cls(
            policy,
            base.max_batch if max_batch is None else max_batch,
            base.max_wait_ms if max_wait_ms is None else max_wait_ms,
            base.flush_on_idle_worker,
            reserve_ms=base.reserve_ms if reserve_ms is None else reserve_ms,
            max_batch_tokens=max_batch_tokens,
        )


@dataclass(slots=True)
class Pending(Generic[Item]):
    """One request waiting in an accumulator. Times are the local monotonic clock, in seconds."""

    item: Item
    partition: int
    offset: int
    arrived_s: float
    deadline_s: float
    rank: int = 1
    """Its priority tier's rank (``schemas.records.Priority.rank``): 0 goes first."""
    read_s: float | None = None
    """When this batcher read it (``arrived_s`` is when the gateway enqueued it), for its spans."""
    tokens: int = 1
    """Its input's length in tokens (``batcher.tokens``), for the token budget."""
    size_bytes: int = 0
    """What it takes in an encoded batch (``schemas.codec.item_bytes``), for a batch's byte limit."""


@dataclass(slots=True)
class Sealed(Generic[Item]):
    items: list[Pending[Item]]
    reason: FlushReason
    sealed_s: float
    min_deadline_s: float = float("inf")
    """The most urgent item's deadline: a sealed batch waiting for a credit still expires on time."""

    def __post_init__(self) -> None:
        if self.min_deadline_s == float("inf") and self.items:
            self.min_deadline_s = min(p.deadline_s for p in self.items)


@dataclass(slots=True)
class Taken(Generic[Item]):
    """What one credit gets: the batch to send, and items that expired before they could go."""

    items: list[Pending[Item]]
    reason: FlushReason | None
    sealed_s: float
    expired: list[Pending[Item]] = field(default_factory=list)


class _ModelQueue(Generic[Item]):
    __slots__ = ("gap_s", "last_read_s", "min_deadline_s", "pending", "rank_seen", "sealed", "shares", "tiered")

    def __init__(self, min_share: float) -> None:
        self.shares = TierShares(min_share)
        self.tiered = False
        """Items of two tiers came since the queue held one tier only: takes go by tier."""
        self.rank_seen: int | None = None
        """The one tier held while ``tiered`` is off (None: nothing came yet)."""
        self.pending: list[Pending[Item]] = []
        self.sealed: deque[Sealed[Item]] = deque()
        self.min_deadline_s = float("inf")
        self.last_read_s = float("-inf")
        self.gap_s = float("inf")
        """Moving average of the time between arrivals (the inverse of the arrival rate)."""

    def arrived(self, now: float) -> None:
        if self.last_read_s != float("-inf"):
            gap = now - self.last_read_s
            self.gap_s = gap if self.gap_s == float("inf") else 0.9 * self.gap_s + 0.1 * gap
        self.last_read_s = now


class BatchFormer(Generic[Item]):
    """Per-model accumulators (over all partitions the batcher owns) and their sealed batches."""

    def __init__(self, policy: FlushPolicy, clock: Callable[[], float], min_share: float = DEFAULT_MIN_SHARE) -> None:
        TierShares(min_share)  # refuses a share out of range here, not at the first request
        self.policy = policy
        self.clock = clock
        self.min_share = min_share
        self._models: dict[str, _ModelQueue[Item]] = {}

    def _queue(self, model: str) -> _ModelQueue[Item]:
        queue = self._models.get(model)
        if queue is None:
            queue = self._models[model] = _ModelQueue(self.min_share)
        return queue

    # feeding ---------------------------------------------------------------------------------
    def add(self, model: str, pending: Pending[Item]) -> None:
        queue = self._queue(model)
        queue.arrived(self.clock())
        queue.pending.append(pending)
        if queue.rank_seen is None:
            queue.rank_seen = pending.rank
        elif pending.rank != queue.rank_seen:
            queue.tiered = True
        if pending.deadline_s < queue.min_deadline_s:
            queue.min_deadline_s = pending.deadline_s
        if len(queue.pending) >= self.policy.max_batch:
            self._seal(queue, FlushReason.FULL, self.clock())

    def _seal(self, queue: _ModelQueue[Item], reason: FlushReason, now: float) -> None:
        queue.sealed.append(Sealed(queue.pending, reason, now, queue.min_deadline_s))
        queue.pending = []
        queue.min_deadline_s = float("inf")

    def _timer_due_s(self, queue: _ModelQueue[Item]) -> float | None:
        """When this queue's seal trigger fires (pending items only)."""
        if not queue.pending:
            return None
        due = queue.pending[0].arrived_s + self.policy.max_wait_ms / 1000.0
        if self.policy.deadline_margin_ms > 0:
            due = min(due, queue.min_deadline_s - self.policy.deadline_margin_ms / 1000.0)
        return due

    # timers ----------------------------------------------------------------------------------
    def next_due_s(self) -> float | None:
        """When ``tick`` next has something to seal or ``expire`` something to end (monotonic seconds), or None.

        Deadlines count wherever an item waits: pending, or sealed in a batch that waits for a
        credit (every worker of its model busy, hung or gone)."""
        dues: list[float] = []
        for queue in self._models.values():
            due = self._timer_due_s(queue)
            if due is not None:
                dues.append(due)
            if queue.pending:
                dues.append(queue.min_deadline_s)
            dues.extend(sealed.min_deadline_s for sealed in queue.sealed)
        return min(dues) if dues else None

    def tick(self) -> list[str]:
        """Seals every accumulator whose age or deadline trigger has passed; returns those models."""
        now = self.clock()
        sealed: list[str] = []
        for model, queue in self._models.items():
            due = self._timer_due_s(queue)
            if due is not None and due <= now:
                first_due = queue.pending[0].arrived_s + self.policy.max_wait_ms / 1000.0
                self._seal(queue, FlushReason.MAX_WAIT if first_due <= now else FlushReason.DEADLINE, now)
                sealed.append(model)
        return sealed

    # dispatch --------------------------------------------------------------------------------
    def ready(self, model: str) -> bool:
        """Whether a credit for ``model`` would get a batch now (so the dispatcher should claim one)."""
        queue = self._models.get(model)
        if queue is None:
            return False
        return bool(queue.sealed) or (self.policy.flush_on_idle_worker and bool(queue.pending))

    def sealed(self, model: str) -> bool:
        """Whether a sealed batch waits for ``model`` (filled up, or sealed by age or deadline)."""
        queue = self._models.get(model)
        return queue is not None and bool(queue.sealed)

    def reserve_s(
        self, model: str, call_s: float, claimed_from_s: float | None = None, worker_free_s: float | None = None
    ) -> float:
        """How long to keep a just-claimed idle worker in reserve rather than send it what waits.

        At low load most latency comes from arrivals that find every worker busy. Items that
        already waited for a worker have lost that race; a fresh arrival has not. So when only
        stale items wait and the load is light, the batcher holds the idle worker for up to this
        long: a fresh arrival takes it at once (with the stale items), or a second worker that
        frees takes the stale items and this one stays idle. It trades some tail latency at low
        load for a median at the backend's latency; at higher load fresh arrivals never stop and
        this returns 0 (plain work conservation).

        The items are stale when the worker came more than ``fresh_ms`` after the newest of them
        arrived, or after the dispatcher began claiming (``claimed_from_s``, default now) if that
        was later: so a request that found a worker idle is fresh, the claim's round trip aside.
        The worker came when it became idle (``worker_free_s``, from its credit) if that is known,
        else now: a claim slowed by a busy event loop or store then does not make items stale.
        """
        policy = self.policy
        queue = self._models.get(model)
        if (
            policy.reserve_ms <= 0
            or not policy.flush_on_idle_worker
            or queue is None
            or queue.sealed
            or not queue.pending
            or call_s <= 0
        ):
            return 0.0
        now = self.clock()
        newest = queue.last_read_s if claimed_from_s is None else max(queue.last_read_s, claimed_from_s)
        came_s = now if worker_free_s is None else min(now, worker_free_s)
        if came_s - newest <= policy.fresh_ms / 1000.0:
            return 0.0
        if call_s >= policy.reserve_max_load * queue.gap_s:  # the load, call over gap; a gap may be 0
            return 0.0
        return policy.reserve_ms / 1000.0

    def take(self, model: str, limit: int = 0, max_bytes: int = 0) -> Taken[Item]:
        """The batch for one credit: the oldest sealed batch, else (work-conserving) all pending.

        ``limit`` (the claiming worker's own max batch, 0 for none) cuts a larger batch; so does
        ``max_bytes`` (the most its items may take together, ``Pending.size_bytes``; 0 for none: a
        batch is one record on the bus, and a record over the bus's limit is refused however often it
        is sent). The rest stays at the head of the line for the next credit. The first item goes
        whatever its size.
        """
        taken = self._take(model, limit)
        if max_bytes <= 0:
            return taken
        size, fit = 0, 0
        for pending in taken.items:
            size += pending.size_bytes
            if size > max_bytes and fit > 0:
                break
            fit += 1
        if fit < len(taken.items):
            self.give_back(model, Taken(taken.items[fit:], taken.reason, taken.sealed_s))
            taken.items = taken.items[:fit]
        return taken

    def _take(self, model: str, limit: int) -> Taken[Item]:
        queue = self._models.get(model)
        now = self.clock()
        if queue is None:
            return Taken([], None, now)
        if self.policy.max_batch_tokens > 0:
            return self._take_by_budget(queue, now, limit)
        if queue.tiered:
            taken = self._take_by_tier(queue, now, limit)
            if taken is not None:
                return taken
        if queue.sealed:
            sealed = queue.sealed.popleft()
        elif self.policy.flush_on_idle_worker and queue.pending:
            self._seal(queue, FlushReason.IDLE_WORKER, now)
            sealed = queue.sealed.popleft()
        else:
            return Taken([], None, now)
        if 0 < limit < len(sealed.items):
            queue.sealed.appendleft(Sealed(sealed.items[limit:], sealed.reason, sealed.sealed_s))
            sealed = Sealed(sealed.items[:limit], sealed.reason, sealed.sealed_s)
        live = [p for p in sealed.items if p.deadline_s > now]
        expired = [p for p in sealed.items if p.deadline_s <= now] if len(live) != len(sealed.items) else []
        return Taken(live, sealed.reason, sealed.sealed_s, expired)

    def _take_by_tier(self, queue: _ModelQueue[Item], now: float, limit: int) -> Taken[Item] | None:
        """``take`` across tiers; None when what could go holds one tier only (the plain take then)."""
        pool = [p for sealed in queue.sealed for p in sealed.items]
        if self.policy.flush_on_idle_worker:
            pool.extend(queue.pending)
        rank = pool[0].rank if pool else None
        if all(p.rank == rank for p in pool):
            if all(p.rank == rank for p in queue.pending):
                queue.tiered, queue.rank_seen = False, rank  # one tier again: the plain take, at no cost
            self._regroup(queue)
            return None
        expired = [p for p in pool if p.deadline_s <= now]
        live = [p for p in pool if p.deadline_s > now] if expired else pool
        slots = min(self.policy.max_batch, limit) if limit > 0 else self.policy.max_batch
        quota = queue.shares.split(ranks_waiting([p.rank for p in live]), slots)
        chosen: list[Pending[Item]] = []
        for pending in live:
            if quota[pending.rank] > 0:
                quota[pending.rank] -= 1
                chosen.append(pending)
        reason, sealed_s = (
            (queue.sealed[0].reason, queue.sealed[0].sealed_s) if queue.sealed else (FlushReason.IDLE_WORKER, now)
        )
        gone = {id(p) for p in chosen} | {id(p) for p in expired}
        for sealed in queue.sealed:
            sealed.items = [p for p in sealed.items if id(p) not in gone]
            sealed.min_deadline_s = min((p.deadline_s for p in sealed.items), default=float("inf"))
        queue.sealed = deque(s for s in queue.sealed if s.items)
        if self.policy.flush_on_idle_worker:
            queue.pending = [p for p in queue.pending if id(p) not in gone]
            queue.min_deadline_s = min((p.deadline_s for p in queue.pending), default=float("inf"))
        return Taken(chosen, reason, sealed_s, expired)

    def _take_by_budget(self, queue: _ModelQueue[Item], now: float, limit: int) -> Taken[Item]:
        """``take`` within the token budget, across everything that could go; what is not taken keeps
        its place (sealed items stay sealed, pending ones pending)."""
        sealed_items = [p for sealed in queue.sealed for p in sealed.items]
        pool = sealed_items + queue.pending if self.policy.flush_on_idle_worker else sealed_items
        if not pool:
            return Taken([], None, now)
        reason, sealed_s = (
            (queue.sealed[0].reason, queue.sealed[0].sealed_s) if queue.sealed else (FlushReason.IDLE_WORKER, now)
        )
        expired = [p for p in pool if p.deadline_s <= now]
        live = [p for p in pool if p.deadline_s > now] if expired else pool
        slots = min(self.policy.max_batch, limit) if limit > 0 else self.policy.max_batch
        head = None
        waiting = ranks_waiting([p.rank for p in live])
        if sum(1 for count in waiting if count) > 1:
            # Lengths, not slots, bound a budgeted batch, so tiers share the batches themselves: the split
            # of one "slot" names the tier whose most urgent item heads this batch (``batcher.tiers``).
            turn = queue.shares.split(waiting, 1).index(1)
            head = min((p for p in live if p.rank == turn), key=lambda p: p.deadline_s)
        chosen = within_budget(live, self.policy.max_batch_tokens, slots, head=head)
        gone = {id(p) for p in chosen} | {id(p) for p in expired}
        kept_sealed = [p for p in sealed_items if id(p) not in gone]
        queue.sealed = deque([Sealed(kept_sealed, reason, sealed_s)] if kept_sealed else [])
        if self.policy.flush_on_idle_worker:
            queue.pending = [p for p in queue.pending if id(p) not in gone]
            queue.min_deadline_s = min((p.deadline_s for p in queue.pending), default=float("inf"))
        return Taken(chosen, reason, sealed_s, expired)

    def _regroup(self, queue: _ModelQueue[Item]) -> None:
        """Sealed batches that takes by tier thinned out become full ones again, in the same order."""
        if len(queue.sealed) < 2 or all(len(s.items) >= self.policy.max_batch for s in queue.sealed):
            return
        head = queue.sealed[0]
        items = [p for sealed in queue.sealed for p in sealed.items]
        size = self.policy.max_batch
        queue.sealed = deque(
            Sealed(items[at : at + size], head.reason, head.sealed_s) for at in range(0, len(items), size)
        )

    def give_back(self, model: str, taken: Taken[Item]) -> None:
        """Puts a batch that could not be sent back at the head of the line."""
        if taken.items and taken.reason is not None:
            self._queue(model).sealed.appendleft(Sealed(taken.items, taken.reason, taken.sealed_s))

    def expire(self) -> list[Pending[Item]]:
        """Removes and returns every held item whose deadline has passed (so callers learn at once)."""
        now = self.clock()
        out: list[Pending[Item]] = []
        for queue in self._models.values():
            if queue.min_deadline_s <= now:
                out.extend(p for p in queue.pending if p.deadline_s <= now)
                queue.pending = [p for p in queue.pending if p.deadline_s > now]
                queue.min_deadline_s = min((p.deadline_s for p in queue.pending), default=float("inf"))
            for sealed in queue.sealed:
                if sealed.min_deadline_s <= now:
                    out.extend(p for p in sealed.items if p.deadline_s <= now)
                    sealed.items = [p for p in sealed.items if p.deadline_s > now]
                    sealed.min_deadline_s = min((p.deadline_s for p in sealed.items), default=float("inf"))
            queue.sealed = deque(s for s in queue.sealed if s.items)
        return out

    def drop_partitions(self, partitions: Iterable[int]) -> list[Pending[Item]]:
        """Forgets items from partitions this batcher lost; their new owner reads them again."""
        lost = frozenset(partitions)
        dropped: list[Pending[Item]] = []
        for queue in self._models.values():
            dropped.extend(p for p in queue.pending if p.partition in lost)
            queue.pending = [p for p in queue.pending if p.partition not in lost]
            queue.min_deadline_s = min((p.deadline_s for p in queue.pending), default=float("inf"))
            for sealed in queue.sealed:
                dropped.extend(p for p in sealed.items if p.partition in lost)
                sealed.items = [p for p in sealed.items if p.partition not in lost]
                sealed.min_deadline_s = min((p.deadline_s for p in sealed.items), default=float("inf"))
            queue.sealed = deque(s for s in queue.sealed if s.items)
        return dropped

    def models(self) -> list[str]:
        return list(self._models)

    def held(self, model: str) -> int:
        queue = self._models.get(model)
        if queue is None:
            return 0
        return len(queue.pending) + sum(len(s.items) for s in queue.sealed)


LENGTH_SPREAD = 1.5
"""A budgeted batch's longest input is at most this many times its shortest, so padding stays under
a third of it (a sixth with lengths spread evenly); the rest wait for a batch of their own length."""


def within_budget(
    candidates: list[Pending[Item]],
    budget: int,
    slots: int,
    *,
    head: Pending[Item] | None = None,
) -> list[Pending[Item]]:
    """A batch from ``candidates`` of at most ``slots`` items whose padded tokens (count x longest)
    stay within ``budget``: ``head``, by default the most urgent item (highest tier, then earliest
    deadline), which goes even alone over the budget (the gateway refuses such inputs; one from
    elsewhere must not block its partition), then the others closest to its length (on a log scale),
    the more urgent first among equals. Grouping by length keeps padding small; starting from the
    most urgent means a long input waits at most until it is the most urgent, and a deadline is never
    traded for it.
    """
    if not candidates:
        return []
    if head is None:
        head = min(candidates, key=lambda p: (p.rank, p.deadline_s))
    chosen = [head]
    longest = head.tokens
    centre = math.log(max(head.tokens, 1))
    others = sorted(
        (p for p in candidates if p is not head),
        key=lambda p: (abs(math.log(max(p.tokens, 1)) - centre), p.rank, p.deadline_s),
    )
    shortest = head.tokens
    for pending in others:
        if len(chosen) >= slots:
            break
        low, high = min(shortest, pending.tokens), max(longest, pending.tokens)
        if high > LENGTH_SPREAD * low:
            continue  # a later one, closer to the chosen's other end, may still fit
        if high * (len(chosen) + 1) <= budget:
            chosen.append(pending)
            shortest, longest = low, high
    return chosen
