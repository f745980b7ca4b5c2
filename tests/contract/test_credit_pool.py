"""CreditPool contract: the soonest-free worker first, each credit claimed once, expired credits never handed out."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis

from schemas.records import Credit
from schemas.wire import Names
from tests.support.transport_kits import PoolFactory
from transport.memory.credits import MemoryCreditPool
from transport.redis.credits import RedisCreditPool

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0


def credit(
    worker: str, seq: int = 1, model: str = "alpha", ttl_ms: int = 60_000, partition: int = 0, age_ms: int = 0
) -> Credit:
    now = int(time.time() * 1000) - age_ms
    return Credit(worker, model, partition, seq, now, now + ttl_ms)


async def test_the_longest_idle_worker_is_claimed_first(make_pool: PoolFactory) -> None:
    pool = await make_pool()
    offered = [credit(f"w{i}", partition=i, age_ms=30 - 10 * i) for i in range(3)]
    for item in reversed(offered):
        await pool.offer(item)
    assert await pool.idle("alpha") == 3

    claimed = [await pool.claim("alpha", 1.0) for _ in offered]
    assert claimed == offered
    assert await pool.idle("alpha") == 0


async def test_a_worker_that_frees_sooner_is_claimed_before_one_still_busy(make_pool: PoolFactory) -> None:
    """A busy worker offers its next credit early, scored at its call's expected end: an idle
    worker's credit offered after it still goes first."""
    pool = await make_pool()
    now = int(time.time() * 1000)
    early = Credit("busy", "alpha", 0, 1, now, now + 60_000, free_at_ms=now + 40)
    idle = Credit("idle", "alpha", 1, 1, now + 5, now + 60_000, free_at_ms=now + 5)
    await pool.offer(early)
    await pool.offer(idle)

    assert await pool.claim("alpha", 1.0) == idle
    assert await pool.claim("alpha", 1.0) == early


async def test_a_credit_offered_after_a_pause_goes_behind_those_that_free_before_it(make_pool: PoolFactory) -> None:
    """A batcher offers back the credit of a send its bus refused queued at the end of its pause: the
    retry goes to another idle worker, whose partition may take it, before this one again."""
    pool = await make_pool()
    now = int(time.time() * 1000)
    refused = Credit("refused", "alpha", 0, 1, now - 1_000, now + 60_000, free_at_ms=now - 1_000)
    idle = Credit("idle", "alpha", 1, 1, now, now + 60_000, free_at_ms=now)
    busy = Credit("busy", "alpha", 2, 1, now, now + 60_000, free_at_ms=now + 1_000)
    await pool.offer(refused, after_ms=now + 200)
    await pool.offer(idle)
    await pool.offer(busy, after_ms=now)  # earlier than it frees: queued when it frees

    assert [await pool.claim("alpha", 1.0) for _ in range(3)] == [idle, refused, busy]


async def test_a_credit_offered_after_a_pause_can_be_withdrawn(make_pool: PoolFactory) -> None:
    pool = await make_pool()
    now = int(time.time() * 1000)
    refused = credit("w1")
    await pool.offer(refused, after_ms=now + 200)

    await pool.withdraw(refused)
    assert await pool.idle("alpha") == 0
    assert await pool.claim("alpha", 0.05) is None


async def test_offered_credits_are_read_without_being_claimed(make_pool: PoolFactory) -> None:
    """What a gateway reads for the rates workers state: every waiting credit, none taken."""
    pool = await make_pool()
    offered = [credit("w1"), credit("w2", partition=1)]
    for item in offered:
        await pool.offer(item)

    assert sorted(await pool.offered("alpha"), key=lambda c: c.worker_id) == offered
    assert await pool.offered("beta") == []
    assert await pool.idle("alpha") == 2


async def test_models_have_separate_pools(make_pool: PoolFactory) -> None:
    pool = await make_pool()
    await pool.offer(credit("w1", model="alpha"))

    assert await pool.claim("beta", 0.05) is None
    assert await pool.idle("beta") == 0
    assert await pool.idle("alpha") == 1


async def test_claim_times_out_with_none(make_pool: PoolFactory) -> None:
    pool = await make_pool()
    started = time.monotonic()

    assert await pool.claim("alpha", 0.2) is None
    elapsed = time.monotonic() - started
    assert 0.15 <= elapsed < 2.0, f"claim(0.2) returned after {elapsed:.3f} s"


async def test_zero_timeout_still_takes_an_available_credit(make_pool: PoolFactory) -> None:
    pool = await make_pool()
    offered = credit("w1")
    await pool.offer(offered)

    assert await pool.claim("alpha", 0) == offered


async def test_one_credit_goes_to_exactly_one_of_two_waiting_claimers(make_pool: PoolFactory) -> None:
    batcher_a, batcher_b = await make_pool(), await make_pool()
    claims = {
        asyncio.create_task(batcher_a.claim("alpha", WAIT_S)),
        asyncio.create_task(batcher_b.claim("alpha", WAIT_S)),
    }
    first = credit("w1", seq=1)
    await batcher_a.offer(first)

    done, pending = await asyncio.wait(claims, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1, "exactly one claimer must get the single credit"
    assert done.pop().result() == first
    (other,) = pending
    done, _ = await asyncio.wait({other}, timeout=0.2)
    assert not done, f"the other claimer must still wait, got {other.result() if done else None}"

    second = credit("w2", seq=2)
    await batcher_b.offer(second)
    assert await asyncio.wait_for(other, WAIT_S) == second


async def test_one_waiting_credit_is_claimed_once(make_pool: PoolFactory) -> None:
    batcher_a, batcher_b = await make_pool(), await make_pool()
    offered = credit("w1")
    await batcher_a.offer(offered)

    results = await asyncio.gather(batcher_a.claim("alpha", 0.3), batcher_b.claim("alpha", 0.3))
    assert sorted(results, key=lambda c: c is None) == [offered, None], f"got {results}"


async def test_expired_credits_are_skipped_and_dropped(make_pool: PoolFactory) -> None:
    pool = await make_pool()
    # Idle longer than the fresh one, so it is popped first: made in the same millisecond, the two would
    # tie on their score and Redis would order them by their bytes.
    await pool.offer(credit("stale", ttl_ms=-1000, age_ms=10))
    fresh = credit("fresh")
    await pool.offer(fresh)

    assert await pool.claim("alpha", 1.0) == fresh
    assert await pool.idle("alpha") == 0, "the expired credit must be dropped, not put back"
    await pool.offer(credit("stale2", ttl_ms=-1))
    assert await pool.claim("alpha", 0.1) is None


async def test_an_expired_credit_offered_to_a_waiting_claimer_is_skipped(make_pool: PoolFactory) -> None:
    """A credit given back after it expired (held in reserve or spaced too long, a send that failed)
    names a worker that has offered a fresh one since, or left: sent a batch, it would run two."""
    pool = await make_pool()
    waiting = asyncio.create_task(pool.claim("alpha", WAIT_S))
    await asyncio.sleep(0)  # let it start waiting; the contract holds either way
    await pool.offer(credit("stale", ttl_ms=-1000, age_ms=10))
    fresh = credit("fresh")
    await pool.offer(fresh)

    async with asyncio.timeout(WAIT_S):
        got = await waiting
    assert got == fresh, f"the waiting claim must skip the expired credit and get the fresh one, got {got}"


async def test_withdrawn_credit_is_never_claimed(make_pool: PoolFactory) -> None:
    pool = await make_pool()
    leaving, staying = credit("w1", seq=1), credit("w2", seq=1)
    await pool.offer(leaving)
    await pool.offer(staying)

    await pool.withdraw(leaving)
    assert await pool.idle("alpha") == 1
    assert await pool.claim("alpha", 1.0) == staying
    await pool.withdraw(leaving)  # withdrawing what is gone is a no-op


async def test_a_cancelled_claim_does_not_eat_a_later_credit(make_pool: PoolFactory) -> None:
    pool = await make_pool()
    cancelled = asyncio.create_task(pool.claim("alpha", WAIT_S))
    await asyncio.sleep(0)  # let it start waiting; the contract holds either way
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled

    offered = credit("w1")
    await pool.offer(offered)
    assert await pool.claim("alpha", WAIT_S) == offered


async def test_claims_that_ran_out_or_were_cancelled_leave_no_waiter_in_the_memory_pool() -> None:
    """A model whose workers are all gone is claimed every ``claim_timeout_s`` for as long as it lasts:
    each claim's waiter goes with it, not at the next offer, which may never come."""
    pool = MemoryCreditPool()
    for _ in range(100):
        assert await pool.claim("alpha", 0.0) is None
        claim = asyncio.create_task(pool.claim("alpha", WAIT_S))
        await asyncio.sleep(0)  # one loop turn: the claim starts waiting
        claim.cancel()
        await asyncio.gather(claim, return_exceptions=True)
    assert not pool._waiters.get("alpha"), f"{len(pool._waiters['alpha'])} waiters left by 200 claims"


async def test_a_credit_set_outlives_its_credits_only_a_while(redis_url: str, names: Names) -> None:
    """Workers killed while idle never withdraw their credits: the model's set then expires a while after the
    last credit in it would, rather than holding credits no claim can use for good. A shorter-lived credit
    offered beside a longer one does not cut the longer one's time short."""
    pool = RedisCreditPool(redis_url, names)
    redis = Redis.from_url(redis_url)
    key = names.credit_queue("alpha")
    try:
        await pool.start()
        await pool.offer(credit("long", ttl_ms=120_000))
        long_ttl_ms = await redis.pttl(key)
        assert 120_000 <= long_ttl_ms <= 3 * 120_000, f"the credit set's TTL is {long_ttl_ms} ms (-1: never dropped)"
        await pool.offer(credit("short", partition=1, ttl_ms=1_000))
        assert await redis.pttl(key) >= long_ttl_ms - 30_000, "a short-lived credit shortened the set's life"
        assert await pool.claim("alpha", 1.0) is not None
        assert await pool.claim("alpha", 1.0) is not None
        await pool.offer(credit("again", seq=2, ttl_ms=60_000))
        assert await redis.pttl(key) >= 60_000, "a set emptied by claims and offered to again has no TTL"
    finally:
        await redis.aclose()
        await pool.close()
