"""Batch bus contract: a batch sent to a partition reaches the worker that owns it, once committed."""

from __future__ import annotations

import time

import pytest

from schemas.records import Batch
from tests.support.bus_records import batch
from tests.support.eventually import eventually
from tests.support.transport_kits import BATCH_PARTITIONS, BatchBusKit
from transport.ports import BatchConsumer, Delivered

pytestmark = pytest.mark.timeout(90)

WAIT_S = 30.0


class Owned:
    def __init__(self) -> None:
        self.partitions: frozenset[int] = frozenset()

    async def on_assigned(self, partitions: frozenset[int]) -> None:
        self.partitions = partitions

    async def on_revoked(self, partitions: frozenset[int]) -> None:
        self.partitions = self.partitions - partitions


async def start(consumer: BatchConsumer) -> Owned:
    owned = Owned()
    await consumer.start(owned.on_assigned, owned.on_revoked)
    return owned


async def test_the_owner_of_a_partition_receives_its_batch(batch_bus: BatchBusKit) -> None:
    producer = await batch_bus.producer()
    workers = [batch_bus.consumer(partition) for partition in range(BATCH_PARTITIONS)]
    owned = [await start(worker) for worker in workers]
    await eventually(
        lambda: all(len(o.partitions) == 1 for o in owned) and owned[0].partitions != owned[1].partitions,
        "each of two workers to own one partition",
        timeout_s=WAIT_S,
    )
    assert [w.assignment() for w in workers] == [o.partitions for o in owned]

    sent = batch("b1", batch_bus.model)
    await producer.send(sent, 1)
    owner, other = (workers[0], workers[1]) if 1 in owned[0].partitions else (workers[1], workers[0])

    delivered = await owner.next(WAIT_S)
    assert delivered is not None, "the owner got nothing"
    assert delivered.value == sent
    assert delivered.partition == 1
    assert await other.next(0.3) is None, "a batch must reach only its partition's owner"
    await owner.commit(delivered)


async def test_next_returns_none_after_its_timeout(batch_bus: BatchBusKit) -> None:
    worker = batch_bus.consumer(0)
    await start(worker)
    started_at = time.monotonic()

    assert await worker.next(0.2) is None
    assert time.monotonic() - started_at < 2.0


async def test_batches_come_one_at_a_time_in_order(batch_bus: BatchBusKit) -> None:
    producer = await batch_bus.producer()
    sent = [batch(f"b{i}", batch_bus.model, size=i + 1) for i in range(5)]
    for item in sent:
        await producer.send(item, 0)
    worker = batch_bus.consumer(0)
    await start(worker)

    got: list[Delivered[Batch]] = []
    for _ in sent:
        delivered = await worker.next(WAIT_S)
        assert delivered is not None, f"only {len(got)} of {len(sent)} batches came"
        got.append(delivered)
        await worker.commit(delivered)
    assert [d.value for d in got] == sent
    assert [d.offset for d in got] == sorted(d.offset for d in got)


async def test_a_committed_batch_does_not_come_again(batch_bus: BatchBusKit) -> None:
    producer = await batch_bus.producer()
    done, next_one = batch("b1", batch_bus.model), batch("b2", batch_bus.model)
    await producer.send(done, 0)
    await producer.send(next_one, 0)

    first = batch_bus.consumer(0)
    await start(first)
    delivered = await first.next(WAIT_S)
    assert delivered is not None
    assert delivered.value == done
    await first.commit(delivered)
    await first.close()

    replacement = batch_bus.consumer(0)
    await start(replacement)
    resumed = await replacement.next(WAIT_S)
    assert resumed is not None, "the uncommitted b2 did not come"
    assert resumed.value == next_one, f"expected b2 after committing b1, got {resumed}"
    await replacement.commit(resumed)
    assert await replacement.next(0.2) is None
