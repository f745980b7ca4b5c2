"""The token budget under a fake clock: no batch's padded tokens exceed it, batches group like lengths,
a long input is not starved by short ones, and deadlines come before the budget."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batcher.policy import LENGTH_SPREAD, BatchFormer, FlushPolicy, Pending, within_budget
from batcher.tiers import DEFAULT_MIN_SHARE
from batcher.tokens import estimated
from tests.support.fake_clock import FakeClock


def item(clock: FakeClock, n: int, tokens: int, ttl_s: float = 30.0, rank: int = 1) -> Pending[str]:
    return Pending(f"r{n}", 0, n, clock(), clock() + ttl_s, rank=rank, tokens=tokens)


def padded(batch: list[Pending[str]]) -> int:
    return max(p.tokens for p in batch) * len(batch)


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=512), min_size=1, max_size=300),
    budget=st.integers(min_value=1, max_value=8192),
    max_batch=st.integers(min_value=1, max_value=100),
    limit=st.integers(min_value=0, max_value=100),
    classic=st.booleans(),
)
def test_no_batch_exceeds_the_budget_and_every_item_goes_once(
    lengths: list[int], budget: int, max_batch: int, limit: int, classic: bool
) -> None:
    clock = FakeClock()
    name = "classic" if classic else "work-conserving"
    former: BatchFormer[str] = BatchFormer(FlushPolicy.named(name, max_batch, 1.0, max_batch_tokens=budget), clock)
    for n, tokens in enumerate(lengths):
        former.add("m", item(clock, n, tokens))
        clock.advance(0.0001)
    clock.advance(0.01)  # classic: every pending item's age seals it
    former.tick()
    taken: list[str] = []
    for _ in range(len(lengths) + 1):
        batch = former.take("m", limit).items
        if not batch:
            break
        lengths_in = [p.tokens for p in batch]
        assert len(batch) == 1 or padded(batch) <= budget, lengths_in
        assert max(lengths_in) <= LENGTH_SPREAD * min(lengths_in), lengths_in
        assert len(batch) <= (min(max_batch, limit) if limit else max_batch)
        taken.extend(p.item for p in batch)
    assert sorted(taken) == sorted(f"r{n}" for n in range(len(lengths))), "each item taken exactly once"
    assert former.held("m") == 0


def test_batches_group_like_lengths_where_count_only_pads_most_of_a_batch() -> None:
    rng = random.Random(7)
    lengths = [min(256, max(1, round(rng.lognormvariate(2.77, 1.19)))) for _ in range(2000)]  # median 16, p99 256

    def padding(budget: int) -> float:
        """The share of all batches' padded tokens that is padding."""
        clock = FakeClock()
        former: BatchFormer[str] = BatchFormer(FlushPolicy.named("work-conserving", 32, max_batch_tokens=budget), clock)
        real = padded_tokens = 0
        for n, tokens in enumerate(lengths):
            former.add("m", item(clock, n, tokens))
            if n % 32 == 31:  # a worker frees every 32 arrivals
                batch = former.take("m").items
                real += sum(p.tokens for p in batch)
                padded_tokens += padded(batch)
        return 1 - real / padded_tokens

    by_count, by_budget = padding(0), padding(2048)
    assert by_count > 0.5, f"count only pads most of a batch with these lengths: {by_count:.2f}"
    assert by_budget < 0.2, f"the budget groups like lengths: {by_budget:.2f} of padding against {by_count:.2f}"


def test_a_long_input_is_not_starved_by_a_stream_of_short_ones() -> None:
    clock = FakeClock()
    former: BatchFormer[str] = BatchFormer(FlushPolicy.named("work-conserving", 100, max_batch_tokens=512), clock)
    for n in range(50):
        former.add("m", item(clock, n, 8))
    clock.advance(0.001)
    former.add("m", item(clock, 999, 400))  # its length fits only a batch of one
    taken_at = None
    for step in range(20):
        clock.advance(0.001)
        for n in range(40):  # shorts keep coming faster than a batch takes them
            former.add("m", item(clock, 1000 + 40 * step + n, 8))
        if "r999" in [p.item for p in former.take("m").items]:
            taken_at = step
            break
    # The shorts that came before it go first (one batch: they fit 64 a batch), then it does.
    assert taken_at == 1, f"the long input went at take {taken_at}"


def test_an_urgent_item_goes_first_whatever_its_length() -> None:
    clock = FakeClock()
    former: BatchFormer[str] = BatchFormer(FlushPolicy.named("work-conserving", 100, max_batch_tokens=256), clock)
    for n in range(60):
        former.add("m", item(clock, n, 4))
    former.add("m", item(clock, 500, 100, ttl_s=0.5))  # arrives last, its deadline first
    batch = former.take("m").items
    assert batch[0].item == "r500", "the batch starts with the item whose deadline is nearest"
    assert padded(batch) <= 256


def test_a_higher_tier_heads_the_batch() -> None:
    clock = FakeClock()
    candidates = [item(clock, n, 10 + n) for n in range(10)] + [item(clock, 99, 50, ttl_s=60, rank=0)]
    assert within_budget(candidates, 1000, 100)[0].item == "r99"


def test_one_that_would_stretch_the_spread_is_passed_over_not_the_end_of_the_batch() -> None:
    """After a longer one was taken, a shorter one can break the spread while a later, longer one, still
    within it, fits: 10 heads, 14 joins, 7 would make 14 twice it, and 15 still goes."""
    clock = FakeClock()
    head = item(clock, 0, 10, ttl_s=1)
    candidates = [head, item(clock, 1, 14, ttl_s=2), item(clock, 2, 7, ttl_s=3), item(clock, 3, 15, ttl_s=4)]
    assert sorted(p.tokens for p in within_budget(candidates, 1000, 10)) == [10, 14, 15]


def test_a_single_input_over_the_budget_still_goes_alone() -> None:
    clock = FakeClock()
    former: BatchFormer[str] = BatchFormer(FlushPolicy.named("work-conserving", 100, max_batch_tokens=64), clock)
    former.add("m", item(clock, 0, 100))
    former.add("m", item(clock, 1, 4))
    assert [p.item for p in former.take("m").items] == ["r0"], "it does not block its partition"
    assert [p.item for p in former.take("m").items] == ["r1"]


def test_the_estimate_counts_utf8_bytes_four_to_a_token() -> None:
    assert estimated("") == 1 and estimated("abcd") == 1 and estimated("abcde") == 2
    assert estimated("é" * 4) == 2, "UTF-8 bytes, not characters"


def test_a_negative_budget_is_refused_naming_its_setting() -> None:
    with pytest.raises(ValueError, match="BATCHWIRE_MAX_BATCH_TOKENS"):
        FlushPolicy.named("work-conserving", max_batch_tokens=-1)


def test_a_lower_tier_heads_its_share_of_the_batches_under_a_token_budget() -> None:
    """priority.md's promise that no tier starves, under a token budget, where lengths and not slots bound
    a batch: a waiting lower tier heads at least ``--tier-min-share`` of the batches, whatever a higher
    tier sends (with the lowest tier's inputs longer, no other tier's item shares its batches)."""
    clock = FakeClock()
    former: BatchFormer[str] = BatchFormer(
        FlushPolicy.named("work-conserving", 8, 1000.0, reserve_ms=0, max_batch_tokens=4096), clock
    )
    for n in range(200):
        former.add("m", Pending(f"low{n}", 0, n, clock(), clock() + 600, rank=2, tokens=40))
    with_low = 0
    for b in range(100):
        for n in range(8):
            former.add("m", Pending(f"high{b}.{n}", 0, 1000 + 8 * b + n, clock(), clock() + 600, rank=0, tokens=10))
        batch = former.take("m").items
        with_low += any(p.rank == 2 for p in batch)
        clock.advance(0.01)
    assert int(100 * DEFAULT_MIN_SHARE) - 1 <= with_low <= 100 * DEFAULT_MIN_SHARE + 2, (
        f"low headed {with_low} of 100 batches; its share is {DEFAULT_MIN_SHARE:.0%} of them, high the rest"
    )
