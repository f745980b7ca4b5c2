"""While every worker is busy the batcher reads at most every ``read_pace_ms``; a credit ends the pause,
and what was produced before it goes into the batch (``batcher.read_pacing``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from batcher.read_pacing import CATCH_UP_READS, ReadPacing
from batcher.service import Batcher
from batcher.settings import BatcherSettings
from tests.support.eventually import eventually
from tests.support.sim_records import credit, request
from transport.memory.bus import MemoryBatchBus, MemoryCreditPool, MemoryRequestBus, MemoryTaskStore
from transport.routing import Partitioner

PARTITIONS = 4


async def test_reads_pause_only_while_every_worker_is_busy() -> None:
    pacing = ReadPacing(pace_s=60.0)
    await asyncio.wait_for(pacing.after_read(all_busy=False), 1.0)  # a worker is idle: no pause
    assert pacing.pauses == 0

    paused = asyncio.create_task(pacing.after_read(all_busy=True))
    await eventually(lambda: pacing.pauses == 1, "the pause to begin", timeout_s=5)
    assert not paused.done()
    reader_reads = pacing.reads

    async def reader() -> None:  # the consume loop: reads as fast as the pacing lets it
        await paused
        while True:
            await asyncio.sleep(0)  # a read (a fetch) yields to the loop
            await pacing.after_read(all_busy=True)

    loop = asyncio.create_task(reader())
    try:
        await asyncio.wait_for(pacing.catch_up(pauses_before=0, limit_s=30.0), 5.0)
        assert pacing.reads >= reader_reads + CATCH_UP_READS
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def test_no_catch_up_when_the_reads_never_paused() -> None:
    pacing = ReadPacing(pace_s=60.0)
    await pacing.after_read(all_busy=False)
    started = time.monotonic()
    await pacing.catch_up(pauses_before=pacing.pauses, limit_s=30.0)  # no reader runs: it must not wait
    assert time.monotonic() - started < 1.0


async def test_a_catch_up_gives_up_after_its_limit() -> None:
    pacing = ReadPacing(pace_s=60.0)
    paused = asyncio.create_task(pacing.after_read(all_busy=True))
    await eventually(lambda: pacing.pauses == 1, "the pause to begin", timeout_s=5)
    started = time.monotonic()
    await pacing.catch_up(pauses_before=0, limit_s=0.05)  # the reader stopped after one read
    assert 0.04 <= time.monotonic() - started < 2.0
    await asyncio.wait_for(paused, 1.0)  # the catch-up ended the pause


def test_read_pace_is_bounded() -> None:
    with pytest.raises(ValueError, match="BATCHWIRE_READ_PACE_MS"):
        BatcherSettings(read_pace_ms=-1)


async def test_a_credit_ends_the_pause_and_its_batch_holds_what_came_meanwhile() -> None:
    bus = MemoryRequestBus(Partitioner(("sim",), PARTITIONS))
    pool = MemoryCreditPool()
    batches = MemoryBatchBus(2)
    settings = BatcherSettings(models=("sim",), request_partitions=PARTITIONS, read_pace_ms=1000)
    batcher = Batcher(settings, bus.consumer(), batches, pool, MemoryTaskStore())
    await batcher.start()
    try:
        producer = bus.producer()
        await producer.send(request("first"))  # read; no worker is idle, so the dispatcher waits for a credit
        await eventually(lambda: batcher.pacing.pauses >= 1, "the reads to pause", timeout_s=5)
        for n in range(5):
            await producer.send(request(f"later-{n}"))  # produced while the reads pause for a second
        offered = time.monotonic()
        await pool.offer(credit("w1", 1))
        await eventually(lambda: batcher.batches_sent == 1, "the batch", timeout_s=5)
        assert time.monotonic() - offered < 0.8, "the credit should have ended the pause"
        consumer = batches.consumer(1)  # the credit's partition
        sent = await consumer.next(1.0)
        assert sent is not None and sent.value is not None
        assert sorted(item.task_id for item in sent.value.items) == ["first"] + [f"later-{n}" for n in range(5)]
    finally:
        await batcher.close()
