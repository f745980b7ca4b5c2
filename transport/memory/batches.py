"""The embedded mode's batch topic: one queue per partition (one per embedded worker), which the
batcher sends batches to and each worker takes its own from, as from Kafka's batch topic."""

from __future__ import annotations

import asyncio
from collections import deque

from schemas.records import Batch
from transport.ports import Delivered, PartitionsCallback


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

    async def send_again(self, batches: list[Batch], partition: int) -> None:
        """Batches a replaced worker took and never finished, ahead of those sent since, in their order:
        as a replacement reading Kafka from the committed offset meets them first."""
        async with self.changed:
            for batch in reversed(batches):
                self.queues[partition].appendleft(Delivered(batch, partition, self.offsets[partition]))
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
