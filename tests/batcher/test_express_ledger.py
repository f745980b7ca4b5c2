"""ExpressLedger: a request that comes as an express copy and as its Kafka record is batched once,
and its record's offset is finished only once the copy's batch is handed over."""

from __future__ import annotations

from batcher.express import ExpressLedger, Record
from batcher.policy import Pending
from transport.ports import UNKNOWN


def copy_of(task_id: str, partition: int = 3) -> Pending[str]:
    return Pending(task_id, partition, UNKNOWN, 0.0, 60.0, awaiting_record=True)


def test_a_record_whose_copy_is_held_gives_the_copy_its_offset() -> None:
    ledger: ExpressLedger[str] = ExpressLedger()
    pending = copy_of("t1")
    assert ledger.copy("t1", pending)

    assert ledger.record("t1", 3, 41) is Record.HELD
    assert (pending.partition, pending.offset) == (3, 41), "the held copy must now finish offset 41"
    assert not pending.awaiting_record, "the copy has its record's offset now"
    ledger.finished("t1")  # it was handed over with its offset: nothing left to match
    assert ledger.record("t1", 3, 41) is Record.NEW


def test_a_record_whose_copy_was_handed_over_is_done_at_once() -> None:
    ledger: ExpressLedger[str] = ExpressLedger()
    ledger.copy("t1", copy_of("t1"))
    ledger.finished("t1")

    assert ledger.record("t1", 3, 41) is Record.DONE


def test_a_copy_that_comes_after_its_record_is_dropped() -> None:
    ledger: ExpressLedger[str] = ExpressLedger()
    assert ledger.record("t1", 3, 41) is Record.NEW

    assert not ledger.copy("t1", copy_of("t1")), "the request would be batched twice"


def test_a_second_copy_is_dropped() -> None:
    ledger: ExpressLedger[str] = ExpressLedger()
    assert ledger.copy("t1", copy_of("t1"))
    assert not ledger.copy("t1", copy_of("t1"))
    ledger.finished("t1")
    assert not ledger.copy("t1", copy_of("t1"))


def test_copies_of_lost_partitions_are_forgotten() -> None:
    ledger: ExpressLedger[str] = ExpressLedger()
    ledger.copy("t1", copy_of("t1", partition=3))
    ledger.copy("t2", copy_of("t2", partition=4))
    ledger.drop([3])

    assert ledger.record("t1", 3, 41) is Record.NEW, "a dropped copy's record is batched as usual"
    assert ledger.record("t2", 4, 7) is Record.HELD


def test_memory_stays_bounded() -> None:
    ledger: ExpressLedger[str] = ExpressLedger(remember=100)
    for i in range(1000):
        ledger.record(f"t{i}", 0, i)
    assert ledger.copy("t0", copy_of("t0")), "only the newest 100 records are remembered"
    assert not ledger.copy("t999", copy_of("t999"))
