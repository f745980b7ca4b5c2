"""The embedded mode's queue depth: the request log's lag, which Kafka's ``transport.kafka.lag``
reads from the request topic's offsets."""

from __future__ import annotations

import time
from collections.abc import Callable

from telemetry.metrics import REQUEST_LAG
from transport.memory.requests import MemoryRequestBus
from transport.ports import Backlog


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
        """``model``'s counters. Also sets ``batchwire_request_topic_lag`` to the bus's lag: the gateway reads
        its queue here (each submit, its admission's sampler, each ``/metrics``), seldom through ``depth``."""
        REQUEST_LAG.set(self.bus.lag())
        depth = left = 0
        for partition in self.bus.partitioner.partitions_for(model):
            waiting, committed = self.bus.log.partition_lag(partition)
            depth += waiting
            left += committed
        return Backlog(depth, left, self._batches(model) if self._batches is not None else 0, time.monotonic())
