"""The flush policy under a fake clock: no Kafka, no Redis, no sleeps."""

from __future__ import annotations

import pytest

from batcher.policy import BatchFormer, FlushPolicy, FlushReason, Pending
from tests.support.fake_clock import FakeClock


def item(clock: FakeClock, n: int, partition: int = 0, ttl_s: float = 30.0) -> Pending[str]:
    return Pending(f"r{n}", partition, n, clock(), clock() + ttl_s)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_idle_worker_takes_whatever_is_pending_at_once(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(), clock)
    former.add("m", item(clock, 0))
    assert former.ready("m"), "one pending item and an idle worker must flush without waiting for a timer"
    taken = former.take("m")
    assert [p.item for p in taken.items] == ["r0"]
    assert taken.reason is FlushReason.IDLE_WORKER
    assert not former.ready("m")


def test_batches_grow_while_workers_are_busy_and_seal_at_max_batch(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(max_batch=100), clock)
    for n in range(250):
        former.add("m", item(clock, n))
    first, second, third = former.take("m"), former.take("m"), former.take("m")
    assert [len(first.items), len(second.items), len(third.items)] == [100, 100, 50]
    assert [first.reason, second.reason, third.reason] == [FlushReason.FULL, FlushReason.FULL, FlushReason.IDLE_WORKER]
    assert [p.item for p in first.items] == [f"r{n}" for n in range(100)], "FIFO order kept"


def test_max_wait_seals_but_the_batch_still_waits_for_a_credit(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(max_wait_ms=50), clock)
    former.add("m", item(clock, 0))
    assert former.next_due_s() == pytest.approx(clock() + 0.05)
    clock.advance(0.049)
    assert former.tick() == []
    clock.advance(0.002)
    assert former.tick() == ["m"]
    former.add("m", item(clock, 1))
    taken = former.take("m")
    assert taken.reason is FlushReason.MAX_WAIT
    assert [p.item for p in taken.items] == ["r0"], "a sealed batch is not reopened"
    assert [p.item for p in former.take("m").items] == ["r1"]


def test_classic_policy_ignores_idle_workers_and_flushes_on_size_or_time(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.classic(max_batch=32, max_wait_ms=50), clock)
    former.add("m", item(clock, 0))
    assert not former.ready("m"), "the classic policy waits for size or time even with an idle worker"
    assert former.take("m").items == []
    for n in range(1, 32):
        former.add("m", item(clock, n))
    assert former.ready("m")
    taken = former.take("m")
    assert len(taken.items) == 32
    assert taken.reason is FlushReason.FULL
    former.add("m", item(clock, 99))
    clock.advance(0.05)
    assert former.tick() == ["m"]
    assert former.take("m").reason is FlushReason.MAX_WAIT


def test_expired_items_never_reach_a_batch(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(), clock)
    former.add("m", item(clock, 0, ttl_s=0.01))
    former.add("m", item(clock, 1, ttl_s=10))
    clock.advance(0.02)
    taken = former.take("m")
    assert [p.item for p in taken.items] == ["r1"]
    assert [p.item for p in taken.expired] == ["r0"]


def test_expire_reports_items_as_soon_as_their_deadline_passes(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(), clock)
    former.add("m", item(clock, 0, ttl_s=0.01))
    former.add("m", item(clock, 1, ttl_s=5))
    assert former.expire() == []
    clock.advance(0.02)
    assert [p.item for p in former.expire()] == ["r0"]
    assert former.held("m") == 1


def test_deadline_margin_seals_early_for_urgent_items(clock: FakeClock) -> None:
    policy = FlushPolicy(max_batch=100, max_wait_ms=1000, flush_on_idle_worker=False, deadline_margin_ms=100)
    former: BatchFormer[str] = BatchFormer(policy, clock)
    former.add("m", item(clock, 0, ttl_s=0.3))
    assert former.next_due_s() == pytest.approx(clock() + 0.2)
    clock.advance(0.2)
    assert former.tick() == ["m"]
    assert former.take("m").reason is FlushReason.DEADLINE


def test_models_never_share_a_batch(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(), clock)
    former.add("a", item(clock, 0))
    former.add("b", item(clock, 1))
    assert [p.item for p in former.take("a").items] == ["r0"]
    assert [p.item for p in former.take("b").items] == ["r1"]


def test_revoked_partitions_are_dropped_from_pending_and_sealed(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(max_batch=2), clock)
    former.add("m", item(clock, 0, partition=0))
    former.add("m", item(clock, 1, partition=1))  # seals [r0, r1]
    former.add("m", item(clock, 2, partition=1))
    dropped = former.drop_partitions({1})
    assert sorted(p.item for p in dropped) == ["r1", "r2"]
    assert [p.item for p in former.take("m").items] == ["r0"]
    assert former.held("m") == 0


def test_give_back_puts_a_batch_at_the_head(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(), clock)
    former.add("m", item(clock, 0))
    taken = former.take("m")
    former.add("m", item(clock, 1))
    former.give_back("m", taken)
    assert [p.item for p in former.take("m").items] == ["r0"]


def test_policy_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        FlushPolicy.work_conserving(max_batch=0)
    assert FlushPolicy.named("classic").max_batch == 32
    assert FlushPolicy.named("work-conserving", max_batch=10).max_batch == 10


def test_a_worker_with_a_smaller_max_batch_gets_a_cut_batch_and_the_rest_waits(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(max_batch=100), clock)
    for n in range(50):
        former.add("m", item(clock, n))
    small = former.take("m", limit=32)
    assert [p.item for p in small.items] == [f"r{n}" for n in range(32)]
    assert former.ready("m")
    rest = former.take("m")
    assert [p.item for p in rest.items] == [f"r{n}" for n in range(32, 50)], "the remainder keeps its order"


def test_low_load_reserve_holds_an_idle_worker_only_for_stale_items(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(reserve_ms=50), clock)
    former.add("m", item(clock, 0))
    assert former.reserve_s("m", call_s=0.1) == 0.0, "a fresh arrival is sent at once"
    clock.advance(0.2)
    former.add("m", item(clock, 1))  # arrivals 200 ms apart: 0.5 per 100 ms call, light load
    clock.advance(0.03)
    assert former.reserve_s("m", call_s=0.1) == pytest.approx(0.05), "stale items at light load: hold"
    assert former.reserve_s("m", call_s=0.0) == 0.0, "unknown backend latency: no hold"
    assert former.reserve_s("m", call_s=0.1, claimed_from_s=clock() - 0.02) == pytest.approx(0.05), (
        "items that waited 20 ms for the claim to find a worker are stale"
    )
    assert former.reserve_s("m", call_s=0.1, claimed_from_s=clock() - 0.002) == 0.0, (
        "the claim found a worker within its round trip: the items did not wait for one"
    )
    assert former.reserve_s("m", call_s=0.1, claimed_from_s=clock() - 0.02, worker_free_s=clock() - 1) == 0.0, (
        "a worker idle before the items came: fresh, however long the claim took"
    )
    assert former.reserve_s("m", call_s=0.1, worker_free_s=clock() - 0.001) == pytest.approx(0.05), (
        "a worker that freed after the items came: they waited for it"
    )


def test_reserve_is_off_under_load_and_for_sealed_batches(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(reserve_ms=50), clock)
    for n in range(20):  # 1 ms apart: 100 arrivals per 100 ms call
        former.add("m", item(clock, n))
        clock.advance(0.001)
    clock.advance(0.01)
    assert former.reserve_s("m", call_s=0.1) == 0.0, "heavy load: plain work conservation"
    classic: BatchFormer[str] = BatchFormer(FlushPolicy.classic(), clock)
    classic.add("m", item(clock, 0))
    clock.advance(1)
    assert classic.reserve_s("m", call_s=0.1) == 0.0, "the classic policy has no reserve"
    sealed: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(max_batch=1, reserve_ms=50), clock)
    sealed.add("m", item(clock, 0))
    clock.advance(1)
    assert sealed.reserve_s("m", call_s=0.1) == 0.0, "a sealed batch goes at once"


def test_arrivals_read_at_one_instant_mean_heavy_load_not_a_crash(clock: FakeClock) -> None:
    """A poll hands over many records read at one clock reading: the first gap is 0, a load beyond
    any bound, and the reserve is off."""
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(reserve_ms=50), clock)
    former.add("m", item(clock, 0))
    former.add("m", item(clock, 1))
    clock.advance(0.03)
    assert former.reserve_s("m", call_s=0.1) == 0.0, "a zero gap is heavy load: plain work conservation"


def test_a_sealed_batch_waiting_for_a_credit_still_expires_on_time(clock: FakeClock) -> None:
    """Every worker busy, hung or gone: the batch sealed by age waits, and its deadlines still wake the timer."""
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(max_wait_ms=1000), clock)
    former.add("m", item(clock, 0, ttl_s=2.0))
    former.add("m", item(clock, 1, ttl_s=3.0))
    clock.advance(1.0)
    assert former.tick() == ["m"] and former.sealed("m")
    assert former.next_due_s() == pytest.approx(clock() + 1.0), "the sealed batch's first deadline is due"
    clock.advance(1.0)
    assert [p.item for p in former.expire()] == ["r0"]
    assert former.next_due_s() == pytest.approx(clock() + 1.0), "then the next one"
    clock.advance(1.0)
    assert [p.item for p in former.expire()] == ["r1"]
    assert former.held("m") == 0 and former.next_due_s() is None


def test_pending_items_expire_at_their_deadline_before_max_wait(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(max_wait_ms=1000), clock)
    former.add("m", item(clock, 0, ttl_s=0.2))
    assert former.next_due_s() == pytest.approx(clock() + 0.2)


def test_a_batch_cut_by_a_workers_limit_keeps_its_deadlines(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(max_batch=4), clock)
    for n in range(4):
        former.add("m", item(clock, n, ttl_s=10.0 - n))
    taken = former.take("m", limit=2)
    assert [p.item for p in taken.items] == ["r0", "r1"]
    assert former.next_due_s() == pytest.approx(clock() + 7.0), "the rest (r2, r3) waits with r3's deadline first"


def test_a_batch_over_the_byte_limit_is_cut_and_the_rest_goes_next_in_order(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(), clock)
    for n in range(5):
        former.add("m", Pending(f"r{n}", 0, n, clock(), clock() + 30, size_bytes=400))
    first = former.take("m", max_bytes=1000)
    assert [p.item for p in first.items] == ["r0", "r1"], "as many as fit in 1000 bytes"
    assert former.ready("m"), "the rest waits at the head of the line for the next credit"
    assert [p.item for p in former.take("m", max_bytes=1000).items] == ["r2", "r3"]
    assert [p.item for p in former.take("m", max_bytes=1000).items] == ["r4"]


def test_an_item_over_the_byte_limit_goes_alone(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(), clock)
    former.add("m", Pending("big", 0, 0, clock(), clock() + 30, size_bytes=5000))
    former.add("m", Pending("small", 0, 1, clock(), clock() + 30, size_bytes=10))
    assert [p.item for p in former.take("m", max_bytes=1000).items] == ["big"]
    assert [p.item for p in former.take("m", max_bytes=1000).items] == ["small"]
