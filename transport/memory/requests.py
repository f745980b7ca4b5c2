"""In-memory transports: the embedded mode's bus, credit pool and task store, and the unit tests'.

They keep the same contracts as the Kafka and Redis ones (the contract tests run against both),
minus durability: a process that dies takes its in-memory work with it. The task store lives in
``memory_store``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

from schemas.records import Batch, Credit, InferenceRequest
from telemetry.metrics import REQUEST_LAG
from transport.memory.store import ENTRY_BYTES, MemoryTaskStore
from transport.ports import Backlog, Delivered, PartitionsCallback
from transport.routing import Partitioner

__all__ = [
    "MemoryBatchBus",
    "MemoryCreditPool",
    "MemoryQueueDepth",
    "MemoryRateLimiter",
    "MemoryRequestBus",
    "MemoryTaskStore",
]

T = TypeVar("T")


def _now_ms() -> int:
    return int(time.time() * 1000)


class _Log(Generic[T]):
    """A partitioned append-only log with committed offsets, trimmed below the commit point.

    ``size`` gives a record's bytes: the log keeps their sum for the records it holds (read or not,
    until trimmed), which is what the log pins in memory."""

    def __init__(self, partitions: int, size: Callable[[T], int]) -> None:
        self.records: list[deque[T]] = [deque() for _ in range(partitions)]
        self.base: list[int] = [0] * partitions  # offset of records[p][0]
        self.committed: list[int] = [0] * partitions
        self.changed = asyncio.Event()
        self._size = size
        self._lag = 0  # kept as records come and commits go: every submit reads it (the gateway's queue depth)
        self._bytes = [0] * partitions

    def append(self, partition: int, value: T) -> int:
        self.records[partition].append(value)
        self._lag += 1
        self._bytes[partition] += self._size(value)
        self.changed.set()
        return self.base[partition] + len(self.records[partition]) - 1

    def read(self, partition: int, position: int, limit: int) -> list[Delivered[T]]:
        records = self.records[partition]
        start = position - self.base[partition]
        out: list[Delivered[T]] = []
        for index in range(max(start, 0), min(len(records), max(start, 0) + limit)):
            out.append(Delivered(records[index], partition, self.base[partition] + index))
        return out

    def end(self, partition: int) -> int:
        return self.base[partition] + len(self.records[partition])

    def commit(self, partition: int, offset: int) -> None:
        if offset <= self.committed[partition]:
            return
        self._lag -= offset - self.committed[partition]
        self.committed[partition] = offset
        records = self.records[partition]
        while self.base[partition] < offset and records:
            self._bytes[partition] -= self._size(records.popleft())
            self.base[partition] += 1

    def lag(self) -> int:
        """Records not yet committed, over all partitions."""
        return self._lag

    def partition_lag(self, partition: int) -> tuple[int, int]:
        """(records not yet committed, the commit point) of one partition."""
        end = self.base[partition] + len(self.records[partition])
        return end - self.committed[partition], self.committed[partition]

    def held_bytes(self, partitions: Iterable[int]) -> int:
        """Bytes of the records ``partitions`` hold (not yet trimmed), by ``size``."""
        return sum(self._bytes[partition] for partition in partitions)


def request_bytes(request: InferenceRequest) -> int:
    """The memory a queued request holds: its input as Python keeps it, and its object and ids."""
    return ENTRY_BYTES + sys.getsizeof(request.input)


class MemoryRequestBus:
    """The request topic: any number of producers (gateways), one consumer (the batcher)."""

    def __init__(self, partitioner: Partitioner) -> None:
        self.partitioner = partitioner
        self.log: _Log[InferenceRequest] = _Log(partitioner.partitions, request_bytes)

    def producer(self) -> MemoryRequestProducer:
        return MemoryRequestProducer(self)

    def consumer(self) -> MemoryRequestConsumer:
        return MemoryRequestConsumer(self)

    def lag(self) -> int:
        return self.log.lag()

    @property
    def models(self) -> tuple[str, ...]:
        return self.partitioner.models

    def queued_bytes(self, model: str | None = None) -> int:
        """What the requests (of ``model``, else of all) not yet committed by the batcher hold: their
        inputs, mostly. A model's requests have partitions of their own (``Partitioner``)."""
        if model is None:
            return self.log.held_bytes(range(self.partitioner.partitions))
        return self.log.held_bytes(self.partitioner.partitions_for(model))


class MemoryRequestProducer:
    def __init__(self, bus: MemoryRequestBus) -> None:
        self.bus = bus

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def reachable(self) -> bool:
        return True

    async def send(self, request: InferenceRequest) -> None:
        self.bus.log.append(self.bus.partitioner.choose(request.model), request)

    async def ready(self) -> bool:
        return True


class MemoryRequestConsumer:
    def __init__(self, bus: MemoryRequestBus) -> None:
        self.log = bus.log
        self.partitions = bus.partitioner.partitions
        self._positions = [0] * self.partitions
        self._assigned: frozenset[int] = frozenset()
        self._on_revoked: PartitionsCallback | None = None

    async def start(self, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback) -> None:
        self._assigned = frozenset(range(self.partitions))
        self._on_revoked = on_revoked
        self._positions = list(self.log.committed)
        await on_assigned(self._assigned)

    async def close(self) -> None:
        if self._on_revoked is not None and self._assigned:
            await self._on_revoked(self._assigned)
        self._assigned = frozenset()

    async def fetch(self, timeout_s: float, max_records: int) -> Sequence[Delivered[InferenceRequest]]:
        deadline = time.monotonic() + timeout_s
        while True:
            self.log.changed.clear()
            out: list[Delivered[InferenceRequest]] = []
            for partition in sorted(self._assigned):
                got = self.log.read(partition, self._positions[partition], max_records - len(out))
                if got:
                    self._positions[partition] = got[-1].offset + 1
                    out.extend(got)
                if len(out) >= max_records:
                    break
            remaining = deadline - time.monotonic()
            if out or remaining <= 0:
                return out
            try:
                async with asyncio.timeout(remaining):
                    await self.log.changed.wait()
            except TimeoutError:
                return []

    async def commit(self, offsets: Mapping[int, int]) -> None:
        for partition, offset in offsets.items():
            self.log.commit(partition, offset)

    def assignment(self) -> frozenset[int]:
        return self._assigned


class MemoryBatchBus:
    """One model's batch topic: a queue per partition, one partition per embedded worker."""

    def __init__(self, partitions: int) -> None:
        self.queues: list[deque[Delivered[Batch]]] = [deque() for _ in range(partitions)]
        self.offsets = [0] * partitions
        self.changed = asyncio.Condition()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def send(self, batch: Batch, partition: int) -> None:
        async with self.changed:
            self.queues[partition].append(Delivered(batch, partition, self.offsets[partition]))
            self.offsets[partition] += 1
            self.changed.notify_all()

    def consumer(self, partition: int) -> MemoryBatchConsumer:
        return MemoryBatchConsumer(self, partition)


class MemoryBatchConsumer:
    def __init__(self, bus: MemoryBatchBus, partition: int) -> None:
        self.bus = bus
        self.partition = partition

    async def start(self, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback) -> None:
        await on_assigned(frozenset({self.partition}))

    async def close(self) -> None:
        return None

    async def next(self, timeout_s: float) -> Delivered[Batch] | None:
        queue = self.bus.queues[self.partition]
        async with self.bus.changed:
            try:
                async with asyncio.timeout(timeout_s):
                    await self.bus.changed.wait_for(lambda: bool(queue))
            except TimeoutError:
                return None
            return queue.popleft()

    async def commit(self, delivered: Delivered[Batch]) -> None:
        return None

    def assignment(self) -> frozenset[int]:
        return frozenset({self.partition})


class MemoryCreditPool:
    """Credits per model, the soonest to free claimed first (``Credit.idle_from_ms``; FIFO among equals);
    a waiting claimer gets the next credit offered, in arrival order."""

    def __init__(self) -> None:
        self._credits: dict[str, deque[Credit]] = {}
        self._waiters: dict[str, deque[asyncio.Future[Credit]]] = {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        for waiters in self._waiters.values():
            for waiter in waiters:
                waiter.cancel()

    async def offer(self, credit: Credit) -> None:
        waiters = self._waiters.get(credit.model)
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(credit)
                return
        credits = self._credits.setdefault(credit.model, deque())
        at = len(credits)
        while at > 0 and credits[at - 1].idle_from_ms > credit.idle_from_ms:
            at -= 1
        credits.insert(at, credit)

    async def withdraw(self, credit: Credit) -> None:
        credits = self._credits.get(credit.model)
        if credits and credit in credits:
            credits.remove(credit)

    async def claim(self, model: str, timeout_s: float) -> Credit | None:
        now = _now_ms()
        credits = self._credits.get(model)
        while credits:
            credit = credits.popleft()
            if credit.expires_at_ms > now:
                return credit
        waiter: asyncio.Future[Credit] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(model, deque()).append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(waiter)
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return waiter.result()  # offered in the same instant the wait ran out
            waiter.cancel()
            return None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                await self.offer(waiter.result())  # hand a credit we will not use to the next claimer
            waiter.cancel()
            raise

    async def idle(self, model: str) -> int:
        return len(self._credits.get(model, ()))

    async def offered(self, model: str) -> list[Credit]:
        return list(self._credits.get(model, ()))


class MemoryQueueDepth:
    """``QueueDepth`` of the embedded mode: the request bus's lag (read on each call, it costs nothing).

    ``batches`` counts the batches handed to a model's workers (the embedded runtime's batch router).
    """

    def __init__(self, bus: MemoryRequestBus, batches: Callable[[str], int] | None = None) -> None:
        self.bus = bus
        self._batches = batches

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def depth(self) -> int | None:
        lag = self.bus.lag()
        REQUEST_LAG.set(lag)
        return lag

    def backlog(self, model: str) -> Backlog:
        depth = left = 0
        for partition in self.bus.partitioner.partitions_for(model):
            waiting, committed = self.bus.log.partition_lag(partition)
            depth += waiting
            left += committed
        return Backlog(depth, left, self._batches(model) if self._batches is not None else 0, time.monotonic())


class MemoryRateLimiter:
    """``RateLimiter`` for one process: token buckets in a dict, forgetting buckets that refilled.

    Same arithmetic as the Redis script (``lua.TOKEN_BUCKET``), on the monotonic clock.
    """

    def __init__(self, rate_per_s: float, burst: int, max_clients: int = 100_000) -> None:
        if not rate_per_s > 0 or burst < 1:
            raise ValueError(f"a rate limiter needs rate_per_s > 0 and burst >= 1, got {rate_per_s} and {burst}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_clients = max_clients
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, at)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def acquire(self, client: str) -> float:
        now = time.monotonic()
        tokens, at = self._buckets.pop(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate_per_s)
        wait_s = 0.0
        if tokens >= 1:
            tokens -= 1
        else:
            wait_s = (1 - tokens) / self.rate_per_s
        self._buckets[client] = (tokens, now)  # most recently used last
        self._forget(now)
        return wait_s

    def _forget(self, now: float) -> None:
        """Drops the least recently used buckets that are full again (forgetting them changes nothing),
        and beyond ``max_clients`` the least recently used ones whatever they hold."""
        full_after_s = self.burst / self.rate_per_s
        while self._buckets:
            client, (_, at) = next(iter(self._buckets.items()))
            if now - at < full_after_s and len(self._buckets) <= self.max_clients:
                return
            del self._buckets[client]
