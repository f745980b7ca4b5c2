"""Records for bus tests: requests and batches to send, reading requests back with a deadline, and
topics of one partition whose raw record values a test reads back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiokafka import AIOKafkaConsumer, TopicPartition  # type: ignore[import-untyped, unused-ignore]
from aiokafka.admin import AIOKafkaAdminClient, NewTopic  # type: ignore[import-untyped, unused-ignore]

from schemas.records import Batch, BatchItem, InferenceRequest
from transport.ports import Delivered, RequestConsumer

WAIT_S = 30.0


def request(task_id: str, model: str) -> InferenceRequest:
    """A request for ``model`` due in 30 s, replying to gateway ``g1``."""
    now = int(time.time() * 1000)
    return InferenceRequest(task_id, model, f"input of {task_id}", now, now + 30_000, reply_to="g1")


def batch(batch_id: str, model: str, size: int = 2) -> Batch:
    """A size-sealed batch of ``size`` items, each due in 30 s."""
    now = int(time.time() * 1000)
    items = tuple(BatchItem(f"{batch_id}-{i}", f"input {i}", now, now + 30_000, "g1") for i in range(size))
    return Batch(batch_id, model, "batcher-1", now, "size", credit="w1:1", items=items)


class Partitions:
    """Records the rebalance callbacks; ``assigned`` is set once partitions arrive."""

    def __init__(self) -> None:
        self.current: frozenset[int] = frozenset()
        self.revoked: list[frozenset[int]] = []
        self.assigned = asyncio.Event()

    async def on_assigned(self, partitions: frozenset[int]) -> None:
        self.current = partitions
        if partitions:
            self.assigned.set()

    async def on_revoked(self, partitions: frozenset[int]) -> None:
        self.revoked.append(partitions)


async def read(consumer: RequestConsumer, count: int) -> list[Delivered[InferenceRequest]]:
    """Fetches until ``count`` records came, failing after ``WAIT_S``."""
    got: list[Delivered[InferenceRequest]] = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < count:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"read {len(got)} of {count} records in {WAIT_S} s"
        got.extend(await consumer.fetch(min(remaining, 1.0), count - len(got)))
    return got


@asynccontextmanager
async def one_partition_topic(bootstrap: str, name: str, configs: dict[str, str] | None = None) -> AsyncIterator[str]:
    """Creates topic ``name`` with one partition (and ``configs``), and deletes it afterwards."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, 1, 1, topic_configs=configs or {})])
        yield name
        await admin.delete_topics([name])
    finally:
        await admin.close()


async def partition_values(bootstrap: str, topic: str) -> list[bytes]:
    """Every record value on ``topic``[0], in order."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        found: list[bytes] = []
        async with asyncio.timeout(WAIT_S):
            while await consumer.position(tp) < end:
                for records in (await consumer.getmany(tp, timeout_ms=1000)).values():
                    found.extend(record.value for record in records)
    finally:
        await consumer.stop()
    return found
