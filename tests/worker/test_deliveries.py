"""The delivery log's contract, in memory, over Redis and over a Redis Cluster: counts, marks, strikes, notes."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from schemas.wire import Names
from tests.support.reply_cutter import ReplyCutter
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
    assert [await log.begin("a", "r1"), await log.begin("a", "r2"), await log.begin("b", "r3")] == [1, 2, 1]
    await log.finish("a")
    assert await log.begin("a", "r4") == 1, "a finished batch starts over"


async def test_without_a_mark_every_given_task_is_a_suspect(log: DeliveryLog) -> None:
    await log.begin("b", "r1")
    suspects = await log.suspects("b", ["t1", "t2"], "r1")
    assert not suspects.marked and suspects.note is None
    assert suspects.task_ids == {"t1", "t2"} and dict(suspects.strikes) == {"t1": 1, "t2": 1}


async def test_a_mark_narrows_the_suspects_and_strikes_accumulate(log: DeliveryLog) -> None:
    await log.suspects("b", ["t1", "t2", "t3"], "r1")  # the first death: all three struck
    await log.mark("b", ["t2", "t3", "gone"])
    await log.note("b", "hung", 0.125)
    suspects = await log.suspects("b", ["t1", "t2", "t3"], "r2")
    assert suspects.marked and suspects.note == "hung" and suspects.call_s == 0.125, suspects
    assert dict(suspects.strikes) == {"t2": 2, "t3": 2}, "only marked tasks still to run are struck"
    again = await log.suspects("b", ["t1", "t2", "t3"], "r3")
    assert not again.marked and again.note is None and again.call_s is None, "reading the mark clears it (and the note)"


async def test_a_call_made_again_with_its_receipt_counts_and_strikes_once(log: DeliveryLog) -> None:
    """A retry after a lost reply (the write ran, its answer never came) calls again with the same receipt."""
    assert [await log.begin("b", "r1"), await log.begin("b", "r1")] == [1, 1], "one receipt, one delivery"
    await log.mark("b", ["t2"])
    await log.note("b", "hung")
    first = await log.suspects("b", ["t1", "t2"], "r1")
    again = await log.suspects("b", ["t1", "t2"], "r1")
    assert first.marked and first.note == "hung" and first.call_s is None and dict(first.strikes) == {"t2": 1}, first
    assert again == first, f"a call made again answers as the first did: {first}, then {again}"
    assert await log.begin("b", "r2") == 2, "another receipt is another delivery"
    later = await log.suspects("b", ["t1", "t2"], "r2")
    assert not later.marked and dict(later.strikes) == {"t1": 1, "t2": 2}, f"struck once per receipt: {later}"


@pytest.mark.kafka
async def test_a_reply_lost_after_the_write_counts_and_strikes_once(infra: Any, names: Names) -> None:
    """The connection drops after Redis ran the script: redis-py's retry runs it again on a new one."""
    cutter = ReplyCutter(infra.redis_url)
    log = RedisDeliveryLog(await cutter.start(), names, ttl_s=60)
    await log.start()
    try:
        await log.begin("warm", "w")  # a connection open and both scripts loaded: the next reply is the call's
        await log.suspects("warm", ["t0"], "w")
        cutter.cut_next()
        count = await log.begin("b", "r1")
        await log.mark("b", ["t2"])
        cutter.cut_next()
        suspects = await log.suspects("b", ["t0", "t1", "t2"], "r1")
    finally:
        await log.close()
        await cutter.close()
    assert cutter.cuts == 2, f"both replies were lost, {cutter.cuts} were"
    assert count == 1, f"a first delivery whose reply was lost is the first, got {count}"
    assert suspects.marked, "the mark read by the lost call is answered again"
    assert dict(suspects.strikes) == {"t2": 1}, f"the marked task struck once, no other: {dict(suspects.strikes)}"


async def test_a_recorded_hand_back_strikes_nothing_and_an_unrecorded_one_still_does(log: DeliveryLog) -> None:
    """A worker that gave the batch back alive (its drain ran out) did not die of its inputs."""
    await log.begin("b", "r1")  # a first delivery, handed back on a graceful stop
    assert await log.hand_back("b", "r1"), "the latest delivery records its hand-back"
    await log.begin("b", "r2")
    handed = await log.suspects("b", ["t1", "t2"], "r2")
    assert handed.handed_back and not handed.task_ids and not handed.strikes, f"no suspect, no strike: {handed}"
    await log.mark("b", ["t1", "t2"])  # r2 runs them, and dies without a word
    await log.begin("b", "r3")
    died = await log.suspects("b", ["t1", "t2"], "r3")
    assert not died.handed_back and dict(died.strikes) == {"t1": 1, "t2": 1}, f"a death strikes: {died}"


async def test_a_hand_back_counts_only_for_the_latest_delivery_once_it_read_the_death_before_it(
    log: DeliveryLog,
) -> None:
    await log.begin("b", "r1")
    await log.mark("b", ["t2"])  # r1 dies running t2
    await log.begin("b", "r2")
    assert not await log.hand_back("b", "r2"), "r2 had not read r1's death: that death still counts"
    assert not await log.hand_back("b", "r1"), "r1's delivery is not the latest"
    assert not await log.hand_back("gone", "r1"), "a batch never counted has nothing to hand back"
    await log.begin("b", "r3")
    suspects = await log.suspects("b", ["t1", "t2"], "r3")
    assert not suspects.handed_back and dict(suspects.strikes) == {"t2": 1}, suspects
    assert await log.hand_back("b", "r3"), "r3 read the death before it"
    await log.begin("b", "r4")
    assert not (await log.suspects("b", ["t1", "t2"], "r4")).strikes, "r3's hand-back strikes nothing"


async def test_a_mark_or_a_note_after_a_hand_back_undoes_it(log: DeliveryLog) -> None:
    """A call that goes on after a revocation's hand-back may still mark its next group, or hang."""
    await log.begin("b", "r1")
    await log.hand_back("b", "r1")
    await log.mark("b", ["t2"])
    await log.begin("b", "r2")
    marked = await log.suspects("b", ["t1", "t2"], "r2")
    assert not marked.handed_back and dict(marked.strikes) == {"t2": 1}, marked
    await log.hand_back("b", "r2")
    await log.note("b", "hung")
    await log.begin("b", "r3")
    hung = await log.suspects("b", ["t1", "t2"], "r3")
    assert hung.note == "hung" and dict(hung.strikes) == {"t1": 1, "t2": 2}, f"a hang strikes: {hung}"
