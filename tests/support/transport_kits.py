"""Transport kits for the contract tests: each bus and store built in memory or over real Kafka and Redis."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from infra.topics import ensure_topics as create_topics
from schemas.wire import Names
from transport.kafka.consumers import KafkaBatchConsumer, KafkaRequestConsumer
from transport.kafka.group import GroupTiming
from transport.kafka.producers import KafkaBatchProducer, KafkaRequestProducer
from transport.memory.batches import MemoryBatchBus
from transport.memory.requests import MemoryRequestBus
from transport.ports import BatchConsumer, BatchProducer, CreditPool, RequestConsumer, RequestProducer, TaskStore
from transport.routing import Partitioner

REAL = "real"
MODELS = ("alpha", "beta")
REQUEST_PARTITIONS = 4
BATCH_PARTITIONS = 2


async def ensure_topics(bootstrap: str, topics: dict[str, int]) -> None:
    """Creates the test's topics (idempotent) on the real Kafka."""
    await create_topics(bootstrap, topics)


class Closer:
    """Closes what a test started, newest first, even when the test failed."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def add(self, item: Any) -> Any:
        self.items.append(item)
        return item

    async def close_all(self) -> None:
        while self.items:
            item = self.items.pop()
            await (item.aclose() if hasattr(item, "aclose") else item.close())  # redis-py clients: aclose


StoreFactory = Callable[..., Awaitable[TaskStore]]
"""Makes one process's view of the task store (``make_store``)."""
PoolFactory = Callable[[], Awaitable[CreditPool]]
"""Makes one process's view of the credit pool (``make_pool``)."""


@dataclass
class RequestBusKit:
    """A request bus in memory or over Kafka, closing what it made at teardown."""

    kind: str
    names: Names
    partitioner: Partitioner
    bootstrap: str | None
    closer: Closer = field(default_factory=Closer)
    memory: MemoryRequestBus | None = None

    async def producer(self) -> RequestProducer:
        producer: RequestProducer
        if self.memory is not None:
            producer = self.memory.producer()
        else:
            assert self.bootstrap is not None
            producer = KafkaRequestProducer(self.bootstrap, self.names, self.partitioner)
        await producer.start()
        return self.closer.add(producer)  # type: ignore[no-any-return]

    def consumer(self) -> RequestConsumer:
        """Not started: the test starts it with its own callbacks (and closes it, or leaves it to teardown)."""
        if self.memory is not None:
            return self.closer.add(self.memory.consumer())  # type: ignore[no-any-return]
        assert self.bootstrap is not None
        return self.closer.add(  # type: ignore[no-any-return]
            KafkaRequestConsumer(self.bootstrap, self.names, timing=GroupTiming(heartbeat_interval_ms=500))
        )


@dataclass
class BatchBusKit:
    """A batch bus in memory or over Kafka, closing what it made at teardown."""

    kind: str
    names: Names
    model: str
    bootstrap: str | None
    closer: Closer = field(default_factory=Closer)
    memory: MemoryBatchBus | None = None

    async def producer(self) -> BatchProducer:
        producer: BatchProducer
        if self.memory is not None:
            producer = self.memory
        else:
            assert self.bootstrap is not None
            producer = KafkaBatchProducer(self.bootstrap, self.names)
        await producer.start()
        return self.closer.add(producer)  # type: ignore[no-any-return]

    def consumer(self, partition: int) -> BatchConsumer:
        """A worker's consumer. In memory it is pinned to ``partition``; over Kafka the group decides."""
        if self.memory is not None:
            return self.closer.add(self.memory.consumer(partition))  # type: ignore[no-any-return]
        assert self.bootstrap is not None
        return self.closer.add(  # type: ignore[no-any-return]
            KafkaBatchConsumer(self.bootstrap, self.names, self.model, timing=GroupTiming(heartbeat_interval_ms=500))
        )
