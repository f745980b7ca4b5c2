"""A request's priority tier survives every transport: the memory bus and Kafka."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from schemas.records import Priority
from tests.support.bus_records import WAIT_S, Partitions, read, request
from tests.support.transport_kits import MODELS, RequestBusKit

pytestmark = pytest.mark.timeout(90)


async def test_each_tier_is_read_as_it_was_sent(request_bus: RequestBusKit) -> None:
    producer = await request_bus.producer()
    sent = [replace(request(f"t-{tier}", MODELS[0]), priority=tier) for tier in Priority]
    for item in sent:
        await producer.send(item)
    consumer = request_bus.consumer()
    partitions = Partitions()
    await consumer.start(partitions.on_assigned, partitions.on_revoked)
    await asyncio.wait_for(partitions.assigned.wait(), WAIT_S)
    got = {d.value.task_id: d.value.priority for d in await read(consumer, len(sent)) if d.value is not None}
    assert got == {s.task_id: s.priority for s in sent}
