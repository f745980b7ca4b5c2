"""Task states on Redis replicas before the Kafka offset behind them is committed (Redis ``WAIT``).

Redis replicates asynchronously: a state that only the primary holds is lost when a Sentinel
promotes a replica. A process that commits only once ``min_replicas`` replicas acknowledged what it
stored never loses a state whose record was committed: a worker a batch's results, a batcher the
requests it ended (expired, or for an unknown model). A store that fewer replicas acknowledged in
time (a replica down or stalled, the primary dead, a failover under way) leaves the record
uncommitted: the states are stored again with backoff, on whichever server is primary by then
(status only moves forward, so a state stored twice is answered once), until enough replicas hold
them. Should the process die meanwhile, the record's next owner handles it again.

``min_replicas=None`` (auto) asks for one replica while the primary reports one connected and in
sync (not still taking its first full copy), else none: a lone Redis costs nothing, and a primary
that has dropped its replica no longer blocks commits. The count is read again after every short
store, so a failover to a primary without replicas ends the wait. Behind Sentinel a count of none is
trusted only from a server the Sentinels confirm as primary; until they do, one replica is asked for.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from schemas.records import TaskState
from telemetry import metrics
from transport.retry import backoff_s, retry

log = logging.getLogger(__name__)

AUTO = "auto"

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ReplicaSettings:
    min_replicas: int | None = None
    """Replicas that must acknowledge the states stored before their commit; None: auto (see the module)."""
    wait_ms: int = 1000
    """How long one store waits for the replicas' acknowledgements (Redis ``WAIT`` timeout)."""
    recount_s: float = 10.0
    """Auto: the primary's replicas are counted again at least this often."""

    def __post_init__(self) -> None:
        if self.min_replicas is not None and self.min_replicas < 0:
            raise ValueError(
                f"redis_min_replicas must be {AUTO} or >= 0, got {self.min_replicas} (BATCHWIRE_REDIS_MIN_REPLICAS)"
            )
        if not 0 < self.wait_ms <= 60_000:
            raise ValueError(
                f"redis_replica_wait_ms must be 1 to 60000, got {self.wait_ms} (BATCHWIRE_REDIS_REPLICA_WAIT_MS)"
            )


def parse_min_replicas(text: str) -> int | None:
    """``auto`` -> None, else a count of replicas."""
    if text.strip().lower() == AUTO:
        return None
    return int(text)


class ReplicatedStore(Protocol):
    """The task store's side of replication (``RedisTaskStore``)."""

    async def apply(self, updates: Sequence[TaskState]) -> list[bool]: ...
    async def connected_replicas(self) -> int: ...
    async def apply_replicated(self, updates: Sequence[TaskState], replicas: int, timeout_ms: int) -> int:
        """Applies ``updates`` and returns how many replicas acknowledged them within ``timeout_ms``."""
        ...


class ReplicaWait:
    """Stores one record's task states at a time until enough replicas hold them; ``waiting`` while short."""

    def __init__(
        self,
        store: ReplicatedStore,
        settings: ReplicaSettings,
        who: str,
        *,
        role: str = "worker",
        retry_max_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.settings = settings
        self.who = who
        self.role = role
        self.retry_max_s = retry_max_s
        self.clock = clock
        self._connected: int | None = None
        self._counted_at = 0.0
        self._short = 0
        self.short_stores = 0
        """Stores that fewer replicas acknowledged in time than required, since start."""

    @property
    def waiting(self) -> bool:
        """States are stored but not yet on enough replicas (a worker takes no new batch meanwhile)."""
        return self._short > 0

    async def required(self) -> int:
        if self.settings.min_replicas is not None:
            return self.settings.min_replicas
        if self._connected is None or self.clock() - self._counted_at >= self.settings.recount_s:
            self._connected = await self.store.connected_replicas()
            self._counted_at = self.clock()
        return min(1, self._connected)

    async def store_results(
        self,
        states: Sequence[TaskState],
        give_up: Callable[[], bool],
        stopping: Callable[[], bool],
        what: str = "storing task states",
    ) -> bool:
        """Stores ``states`` until they are on the required replicas (True), or until ``stopping()``
        holds after a short try (False: stored, not replicated; the record goes back uncommitted).
        Raises a ``TransportError`` that retrying cannot fix, or any once ``give_up()`` holds.
        ``what`` names the write in the retries' log lines."""
        tries = 0
        try:
            while True:
                needed = await self._retry("counting Redis replicas", self.required, give_up)
                if needed == 0:
                    if states:
                        await self._retry(what, lambda: self.store.apply(states), give_up)
                    break
                wait = functools.partial(self.store.apply_replicated, states, needed, self.settings.wait_ms)
                acked = await self._retry(what, wait, give_up)
                if acked >= needed:
                    break
                tries += 1
                if tries == 1:
                    self._short += 1
                self.short_stores += 1
                metrics.RESULTS_UNREPLICATED.labels(process=self.who).inc()
                self._connected = None  # a failover or a lost replica changes the count: ask again
                if tries == 1 or tries % 20 == 0:
                    log.warning(
                        "%s %s: %d of %d Redis replica(s) acknowledged %d task state(s) within %d ms (%d tries); "
                        "their record stays uncommitted and they are stored again",
                        self.role,
                        self.who,
                        acked,
                        needed,
                        len(states),
                        self.settings.wait_ms,
                        tries,
                    )
                if stopping() or give_up():
                    log.warning(
                        "%s %s: stopping; the record whose task states are not on %d Redis replica(s) goes back "
                        "uncommitted",
                        self.role,
                        self.who,
                        needed,
                    )
                    return False
                await asyncio.sleep(backoff_s(tries, self.retry_max_s))
        finally:
            if tries:
                self._short -= 1
        if tries:
            log.info("%s %s: task states on enough Redis replicas after %d short tries", self.role, self.who, tries)
        return True

    async def _retry(self, what: str, op: Callable[[], Awaitable[T]], give_up: Callable[[], bool]) -> T:
        return await retry(log, f"{self.role} {self.who}", what, op, self.retry_max_s, give_up=give_up)
