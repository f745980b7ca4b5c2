"""The delivery log's contract, in memory, over Redis and over a Redis Cluster: counts, marks, strikes, notes."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from schemas.wire import Names
from transport.deliveries import DeliveryLog, MemoryDeliveryLog
from transport.redis.deliveries import RedisDeliveryLog


@pytest.fixture
async def log(keyed_url: str | None) -> AsyncIterator[DeliveryLog]:
    if keyed_url is None:
        yield MemoryDeliveryLog()
        return
    redis_log = RedisDeliveryLog(keyed_url, Names(f"t{uuid.uuid4().hex[:10]}"), ttl_s=60)
    await redis_log.start()
    yield redis_log
    await redis_log.close()


async def test_deliveries_are_counted_per_batch(log: DeliveryLog) -> None:
    assert [await log.begin("a"), await log.begin("a"), await log.begin("b")] == [1, 2, 1]
    await log.finish("a")
    assert await log.begin("a") == 1, "a finished batch starts over"


async def test_without_a_mark_every_given_task_is_a_suspect(log: DeliveryLog) -> None:
    await log.begin("b")
    suspects = await log.suspects("b", ["t1", "t2"])
    assert not suspects.marked and suspects.note is None
    assert suspects.task_ids == {"t1", "t2"} and dict(suspects.strikes) == {"t1": 1, "t2": 1}


async def test_a_mark_narrows_the_suspects_and_strikes_accumulate(log: DeliveryLog) -> None:
    await log.suspects("b", ["t1", "t2", "t3"])  # the first death: all three struck
    await log.mark("b", ["t2", "t3", "gone"])
    await log.note("b", "hung")
    suspects = await log.suspects("b", ["t1", "t2", "t3"])
    assert suspects.marked and suspects.note == "hung"
    assert dict(suspects.strikes) == {"t2": 2, "t3": 2}, "only marked tasks still to run are struck"
    again = await log.suspects("b", ["t1", "t2", "t3"])
    assert not again.marked and again.note is None, "reading the mark clears it (and the note)"
