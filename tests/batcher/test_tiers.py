"""Priority tiers in batch forming, under a fake clock: order, FIFO within a tier, the earned share, deadlines."""

from __future__ import annotations

import math
import random

import pytest

from batcher.policy import BatchFormer, FlushPolicy, Pending
from batcher.tiers import TierShares
from tests.support.fake_clock import FakeClock

HIGH, NORMAL, LOW = 0, 1, 2


def item(clock: FakeClock, name: str, rank: int, ttl_s: float = 30.0) -> Pending[str]:
    return Pending(name, 0, 0, clock(), clock() + ttl_s, rank=rank)


def names(items: list[Pending[str]]) -> list[str]:
    return [p.item for p in items]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_a_batch_takes_high_before_normal_before_low(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(max_batch=4), clock, min_share=0.0)
    for n in range(4):
        former.add("m", item(clock, f"low{n}", LOW))
    for n in range(2):
        former.add("m", item(clock, f"normal{n}", NORMAL))
    former.add("m", item(clock, "high0", HIGH))
    first = former.take("m")
    assert sorted(names(first.items)) == ["high0", "low0", "normal0", "normal1"], (
        f"the batch of 4 should hold the high, both normals and the oldest low; got {names(first.items)}"
    )
    assert names(former.take("m").items) == ["low1", "low2", "low3"]


def test_fifo_within_each_tier_across_sealed_batches(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(max_batch=3), clock, min_share=0.0)
    for n in range(5):
        former.add("m", item(clock, f"low{n}", LOW))
        former.add("m", item(clock, f"high{n}", HIGH))
    taken = [names(former.take("m").items) for _ in range(4)]
    highs = [n for batch in taken for n in batch if n.startswith("high")]
    lows = [n for batch in taken for n in batch if n.startswith("low")]
    assert highs == [f"high{n}" for n in range(5)], f"highs out of arrival order: {taken}"
    assert lows == [f"low{n}" for n in range(5)], f"lows out of arrival order: {taken}"
    assert taken[0] == ["high0", "high1", "high2"]
    assert sorted(taken[1]) == ["high3", "high4", "low0"]


def test_a_waiting_lower_tier_earns_its_share_of_each_batch(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(max_batch=100), clock, min_share=0.1)
    for n in range(1000):
        former.add("m", item(clock, f"high{n}", HIGH))
        former.add("m", item(clock, f"low{n}", LOW))
    for batch in range(5):
        taken = names(former.take("m").items)
        lows = [n for n in taken if n.startswith("low")]
        assert len(taken) == 100
        assert len(lows) == 10, f"batch {batch}: low should get 10 of 100 slots while high floods; got {len(lows)}"


def test_with_batches_of_one_a_lower_tier_still_goes_within_its_share(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(max_batch=1), clock, min_share=0.1)
    former.add("m", item(clock, "low0", LOW))
    for n in range(100):
        former.add("m", item(clock, f"high{n}", HIGH))
    taken = [names(former.take("m").items)[0] for _ in range(20)]
    assert "low0" in taken[:10], f"a low item behind a flood of highs must go within 10 batches of one: {taken}"


def test_strict_priority_with_no_share_holds_the_lower_tier_back(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(max_batch=1), clock, min_share=0.0)
    former.add("m", item(clock, "low0", LOW))
    for n in range(20):
        former.add("m", item(clock, f"high{n}", HIGH))
    taken = [names(former.take("m").items)[0] for _ in range(21)]
    assert taken[-1] == "low0" and "low0" not in taken[:-1]


def test_expired_items_of_any_tier_come_back_expired_and_take_no_slot(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(max_batch=2), clock, min_share=0.0)
    former.add("m", item(clock, "high-short", HIGH, ttl_s=1.0))
    former.add("m", item(clock, "low-short", LOW, ttl_s=1.0))
    former.add("m", item(clock, "high-long", HIGH))
    former.add("m", item(clock, "low-long", LOW))
    clock.advance(2.0)
    taken = former.take("m")
    assert sorted(names(taken.expired)) == ["high-short", "low-short"]
    assert sorted(names(taken.items)) == ["high-long", "low-long"], "expired items must not take a batch's slots"
    assert former.held("m") == 0


def test_tiers_respect_the_claiming_workers_limit(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(max_batch=10), clock, min_share=0.0)
    for n in range(4):
        former.add("m", item(clock, f"low{n}", LOW))
        former.add("m", item(clock, f"high{n}", HIGH))
    assert names(former.take("m", limit=3).items) == ["high0", "high1", "high2"]
    assert former.held("m") == 5


def test_one_tier_alone_takes_the_plain_path_in_arrival_order(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.work_conserving(max_batch=2), clock)
    for n in range(3):
        former.add("m", item(clock, f"low{n}", LOW))
    assert names(former.take("m").items) == ["low0", "low1"]
    assert names(former.take("m").items) == ["low2"]


def test_classic_takes_by_tier_only_among_sealed_batches(clock: FakeClock) -> None:
    former: BatchFormer[str] = BatchFormer(FlushPolicy.classic(max_batch=2, max_wait_ms=50), clock, min_share=0.0)
    former.add("m", item(clock, "low0", LOW))
    former.add("m", item(clock, "low1", LOW))
    former.add("m", item(clock, "high0", HIGH))
    assert names(former.take("m").items) == ["low0", "low1"], "classic sends only sealed batches"
    assert names(former.take("m").items) == []


def test_shares_are_kept_per_tier_and_spent() -> None:
    shares = TierShares(0.25)
    assert shares.split([8, 0, 8], 4) == [3, 0, 1]
    assert shares.split([8, 8, 8], 4) == [2, 1, 1]
    assert shares.split([0, 0, 8], 4) == [0, 0, 4], "a tier behind nothing takes everything"


def test_a_share_above_a_third_is_refused() -> None:
    with pytest.raises(ValueError, match="BATCHWIRE_TIER_MIN_SHARE"):
        TierShares(0.5)


@pytest.mark.parametrize("share", [0.05, 0.1, 0.2, 1 / 3])
def test_every_run_of_batches_gives_each_waiting_tier_its_share_less_one(share: float) -> None:
    rng = random.Random(7)
    shares = TierShares(share)
    sizes = [rng.choice([1, 2, 3, 5, 10, 100]) for _ in range(150)]
    quotas = [shares.split([10**6, 10**6, 10**6], size) for size in sizes]
    for start in range(len(sizes)):
        slots, got = 0, [0, 0, 0]
        for size, quota in zip(sizes[start:], quotas[start:], strict=True):
            slots += size
            got = [g + q for g, q in zip(got, quota, strict=True)]
            for rank in (1, 2):
                assert got[rank] >= math.floor(slots * share) - 1, (
                    f"tier {rank} got {got[rank]} of {slots} slots from batch {start} on, share {share}"
                )
