"""The embedded mode's request topic: a partitioned in-memory log that gateways append to and the
batcher reads and commits, as it does Kafka's request topic.

The log keeps what its records hold in memory (``request_bytes``), so the task store can count the
queued inputs under its byte budget (``MemoryTaskStore``'s ``queued``).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

from schemas.records import InferenceRequest
from transport.memory.store import ENTRY_BYTES
from transport.ports import Delivered, PartitionsCallback
from transport.routing import Partitioner

T = TypeVar("T")


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
        records, base = self.records[partition], self.base[partition]
        start = max(position - base, 0)
        return [Delivered(records[i], partition, base + i) for i in range(start, min(len(records), start + limit))]

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
        self._next = 0
        """Where in the sorted assignment the next fetch begins: after the partition the last one filled
        up at, so fetches go round every partition, as Kafka's do, and one backlog hides no other."""

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
            order = sorted(self._assigned)
            for step in range(len(order)):
                partition = order[(self._next + step) % len(order)]
                if self._positions[partition] >= self.log.end(partition):
                    continue  # nothing new: a fetch wakes on every send to any partition
                got = self.log.read(partition, self._positions[partition], max_records - len(out))
                if got:
                    self._positions[partition] = got[-1].offset + 1
                    out.extend(got)
                if len(out) >= max_records:
                    self._next = (self._next + step + 1) % len(order)
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
