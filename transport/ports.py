"""The small Protocols every transport implements: in memory (embedded mode) and Kafka/Redis.

Services receive these objects in their constructors and never learn which implementation they hold.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from schemas.heartbeat import Beat
from schemas.records import Batch, Credit, InferenceRequest, TaskState, TaskStatus

T_co = TypeVar("T_co", covariant=True)


class TransportError(Exception):
    """A transport could not do what was asked. ``retriable`` says whether trying again may help."""

    retriable = True


@dataclass(frozen=True, slots=True)
class Delivered(Generic[T_co]):
    """A record and where it came from (its partition and offset). ``value`` is None for bytes that
    could not be decoded."""

    value: T_co | None
    partition: int
    offset: int


PartitionsCallback = Callable[[frozenset[int]], Awaitable[None]]


class RequestProducer(Protocol):
    """Gateway side of the request topic."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    def reachable(self) -> bool:
        """False while the bus is known to be down (a send or a readiness probe failed, and no probe
        has reached it since); no I/O, so a gateway can refuse a request at once rather than hold it."""
        ...

    async def send(self, request: InferenceRequest) -> None:
        """Returns once the request is durably accepted by the bus."""
        ...

    async def ready(self) -> bool: ...


class RequestConsumer(Protocol):
    """Batcher side of the request topic. Offsets are committed explicitly, never automatically."""

    async def start(self, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback) -> None: ...
    async def close(self) -> None: ...
    async def fetch(self, timeout_s: float, max_records: int) -> Sequence[Delivered[InferenceRequest]]: ...
    async def commit(self, offsets: Mapping[int, int]) -> None:
        """Commits, per partition, the offset of the next record to read."""
        ...

    def assignment(self) -> frozenset[int]: ...


class BatchProducer(Protocol):
    """Batcher side of a model's batch topic: a batch goes to the partition its credit names."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def send(self, batch: Batch, partition: int) -> None:
        """Returns once the batch is on the bus."""
        ...


class BatchConsumer(Protocol):
    """Worker side of a model's batch topic."""

    async def start(self, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback) -> None: ...
    async def close(self) -> None: ...
    async def next(self, timeout_s: float) -> Delivered[Batch] | None:
        """The next batch, or None when ``timeout_s`` passed without one."""
        ...

    async def commit(self, delivered: Delivered[Batch]) -> None: ...
    def assignment(self) -> frozenset[int]: ...


class CreditPool(Protocol):
    """Idle workers' credits. Each credit is claimed by exactly one batcher."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def offer(self, credit: Credit, *, after_ms: int = 0) -> None:
        """Queues ``credit`` by when its worker frees (``Credit.idle_from_ms``), or at ``after_ms`` when
        later: a credit whose send was refused goes behind the credits that free before the retry."""
        ...

    async def withdraw(self, credit: Credit) -> None: ...
    async def claim(self, model: str, timeout_s: float) -> Credit | None: ...
    async def idle(self, model: str) -> int:
        """How many credits wait unclaimed (idle workers) for ``model``."""
        ...

    async def offered(self, model: str) -> list[Credit]:
        """The credits waiting unclaimed for ``model``, expired ones included; read, not claimed."""
        ...


ReplyHandler = Callable[[TaskState], None]


STALE_AFTER_MS = 2_000
"""How long after its deadline a bound task that has not ended counts as one that never will (no
batcher batches and no worker starts a request past its deadline): the margin covers clocks that
disagree between hosts."""


def binding_ttl_ms(ttl_ms: int, deadline_ms: int | None, now_ms: int) -> int:
    """How long a store keeps a new binding (``claim_key``, ``rebind_key``): ``ttl_ms`` past the moment
    its task goes stale (``STALE_AFTER_MS`` past its deadline), so that the result of a task that ends
    before then, kept ``ttl_ms`` from its end, never outlives its key; ``ttl_ms`` without a deadline."""
    if deadline_ms is None:
        return ttl_ms
    return ttl_ms + max(0, deadline_ms + STALE_AFTER_MS - now_ms)


@dataclass(frozen=True, slots=True)
class KeyClaim:
    """Which task an idempotency key names, the fingerprint of the request that created it, and that
    task's deadline (Unix ms; None for a binding stored without one)."""

    task_id: str
    fingerprint: str
    deadline_ms: int | None = None


class TaskStore(Protocol):
    """Where task status and results live, and how changes reach the gateways.

    Status only moves forward (see ``TaskStatus.rank``); a terminal state is written once, so a
    result computed twice after a redelivery is delivered once. The write that ends a task counts
    it in ``batchwire_tasks_ended`` (``apply``, ``cancel``), so each end is counted once, whoever writes it.
    """

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    def reachable(self) -> bool:
        """False while the store is known to be unreachable (its change feed's connection is down);
        no I/O, so a gateway can refuse a synchronous request at once rather than hold it."""
        ...

    def on_feed_return(self, callback: Callable[[], None]) -> None:
        """Calls ``callback`` each time the change feed is back after a drop, its channels subscribed
        again: what was published while it was down is lost, and a read from then on misses nothing."""
        ...

    def full(self, model: str) -> str | None:
        """Why the store takes no new task for ``model`` now (a memory budget spent on tasks not yet
        ended), else None; no I/O, asked on every submit."""
        ...

    def refuses_writes(self) -> str | None:
        """Why the store's server refuses every write now (its memory full, too few replicas, a disk it cannot
        write), else None; no I/O,
        asked on every submit, so a request whose answer could not be stored is refused at once."""
        ...

    async def create(self, state: TaskState) -> bool:
        """Stores a new task; False if the id exists already.

        A task that a later status reached first (its request raced ahead of this create) counts
        as created: only its owner is filled in, and True is returned.
        """
        ...

    async def apply(self, updates: Sequence[TaskState], *, counted: bool = True) -> list[bool]:
        """Applies status changes in one round trip; per update, whether it changed anything.

        Each applied change is published to the task's watchers, and a terminal one also to the
        gateway named in ``reply_to``. A synchronous task (``reply_to`` set) that no one stored is
        one whose id only its caller will learn, with its end: a change short of the end is only
        checked (True while the task has not ended) and not stored. ``counted=False`` leaves the
        ends out of ``batchwire_tasks_ended``: copies of an end counted where it was written (a
        collapsed computation's, onto its callers' tasks).
        """
        ...

    async def cancel(
        self, task_id: str, reason_code: str, message: str, status: TaskStatus = TaskStatus.CANCELLED
    ) -> TaskState | None:
        """Ends a task no worker has started (``queued`` or ``batched``) as ``status`` (``cancelled``;
        ``failed`` for a gateway's send that failed; ``expired`` for one a gateway reads past its
        deadline), atomically.

        The cancelled state is published like ``apply`` publishes (watchers, and the gateway in
        ``reply_to``), and carries ``reason_code`` and ``message`` as its error. Returns the state
        after the call: ``cancelled`` (by this call or an earlier one), or the unchanged state of a
        task that is running or ended otherwise; None when no such task is stored.
        """
        ...

    async def claim_key(
        self, scope: str, key: str, task_id: str, fingerprint: str, deadline_ms: int | None = None
    ) -> KeyClaim:
        """Binds an idempotency ``key`` (within ``scope``) to ``task_id`` unless it is bound already.

        Returns the binding that holds: ours when this call won, else the first one. A binding is kept
        at least as long as the result of its task (``binding_ttl_ms``).
        """
        ...

    async def rebind_key(
        self,
        scope: str,
        key: str,
        ended_task_id: str,
        task_id: str,
        fingerprint: str,
        deadline_ms: int | None = None,
    ) -> KeyClaim:
        """Binds ``key`` to ``task_id`` if it still names ``ended_task_id`` (or nothing), atomically.

        The gateway calls it for a retry whose task ended without being computed; of two retries
        racing to replace the same task, one wins and the other gets the winner's binding. Returns
        the binding that holds afterwards.
        """
        ...

    async def release_key(self, scope: str, key: str, task_id: str) -> None:
        """Unbinds ``key`` if it still names ``task_id`` (that task could not be stored or published)."""
        ...

    async def get(self, task_id: str) -> TaskState | None: ...
    async def get_many(self, task_ids: Collection[str]) -> dict[str, TaskState]:
        """The tasks found, read at once; one whose stored state cannot be read is logged and left out."""
        ...

    def watch(self, task_id: str) -> AbstractAsyncContextManager[AsyncIterator[TaskState]]:
        """Changes to one task from the moment the context is entered (subscribe, then read state)."""
        ...

    async def listen_replies(self, gateway_id: str, handler: ReplyHandler) -> None:
        """Calls ``handler`` with every terminal state addressed to this gateway until ``close``."""
        ...

    async def ready(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Backlog:
    """One model's queue as counters: what waits now, and how much has moved on since a fixed start.

    ``left`` and ``batches`` only grow; the gateway's admission reads how fast they grow (the
    model's drain rate) and whether they grow at all (a model whose workers are hung or gone).
    """

    depth: int
    """Requests accepted and not yet handed to a worker (nor ended)."""
    left: int
    """Requests that left the queue: handed to a worker, or ended while waiting."""
    batches: int
    """Batches handed to the model's workers."""
    at_s: float
    """When the read of the counters began (monotonic seconds): they hold every request sent before."""


class QueueDepth(Protocol):
    """Requests accepted by the gateways and not yet handed to a worker, across the deployment."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def depth(self) -> int | None:
        """The latest known depth, None while it is unknown (unread, or stale); cheap enough to ask
        on every request (no I/O)."""
        ...

    def backlog(self, model: str) -> Backlog | None:
        """The latest known counters of ``model``'s queue (no I/O); None while they are unknown or stale."""
        ...


class ResultCache(Protocol):
    """Completed answers by key, each kept ``ttl_s``; a miss and an expired entry read the same.

    Both calls raise ``TransportError`` when the backing store fails; the gateway then goes the
    normal way (the cache is bypassed, never failed on)."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def get(self, key: str) -> str | None:
        """The output stored under ``key``, or None."""
        ...

    async def put(self, key: str, output: str, ttl_s: float) -> None: ...


class RateLimiter(Protocol):
    """A token bucket per client (``rate_per_s`` refill, ``burst`` capacity), shared by every gateway."""

    rate_per_s: float
    burst: int

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def acquire(self, client: str, tokens: int = 1) -> float:
        """Takes ``tokens`` (at most ``burst``: one per input of a request) from ``client``'s bucket at
        once: 0.0 if it held them, else the seconds until it will (nothing is taken then). Negative
        ``tokens`` are given back, up to ``burst``: a request refused whole after it took them."""
        ...


class Fleet(Protocol):
    """Every process's heartbeat, beside the task store: what ``batchwire status`` and ``/dashboard`` read."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def beat(self, beats: Sequence[Beat]) -> None:
        """Stores one process's beats (one per role it hosts) in one write, each replacing its last."""
        ...

    async def members(self) -> list[Beat]:
        """The last beat of every member; one past ``FORGET_AFTER_S`` is dropped, not returned."""
        ...
