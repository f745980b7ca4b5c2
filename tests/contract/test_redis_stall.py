"""Redis answers that come while the event loop is blocked past their deadline are taken, not cut off.

The stall is the event loop blocked (``time.sleep``) while Redis answers: the fault under test (a
GC pause, a CPU-starved process), not a synchronisation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from typing import Any

import psutil
import pytest
import redis
import uvloop

from infra.redis_server import RedisServer
from schemas.codec import encode_credit
from schemas.records import Credit
from schemas.wire import Names
from tests.support.busy_redis import busy_redis
from tests.support.eventually import eventually
from transport.ports import TransportError
from transport.redis.credits import CREDITS_POOL, RedisCreditPool
from transport.redis.pools import sync_client

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]

CLAIM_S = 0.5
GRACE_S = 0.5
STALL_S = 2.0
"""Past the claim's wait and its grace together: the answer comes during the stall, its deadline passes in it."""
BUSY_S = 1.0
"""How long Redis is busy before it answers a command sent meanwhile."""
YIELDS = 20
"""Turns of the event loop that a claim takes to send its command (Redis is busy: none answers meanwhile)."""


@pytest.fixture
def sync(redis_url: str) -> Iterator[redis.Redis]:
    client = sync_client(redis_url, 5.0)
    assert isinstance(client, redis.Redis)
    try:
        yield client
    finally:
        client.close()


Run = Callable[[Coroutine[Any, Any, tuple[object, list[Credit]]]], tuple[object, list[Credit]]]
LOOPS = pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
"""Whether the answer or its deadline is handled first after a stall depends on the order a loop runs its
callbacks in: every role runs on uvloop, the other tests on asyncio's loop."""


def credit() -> Credit:
    now = int(time.time() * 1000)
    return Credit("w1", "alpha", 0, 1, now, now + 60_000)


@asynccontextmanager
async def credit_pool(redis_url: str, names: Names) -> AsyncIterator[RedisCreditPool]:
    pool = RedisCreditPool(redis_url, names, claim_grace_s=GRACE_S)
    await pool.start()
    try:
        yield pool
    finally:
        await pool.close()


async def ended(pool: RedisCreditPool, claim: asyncio.Task[Credit | None]) -> tuple[object, list[Credit]]:
    """How the claim ended, and what the pool holds afterwards."""
    return (await asyncio.gather(claim, return_exceptions=True))[0], await pool.offered("alpha")


def assert_claimed_or_kept(offered: Credit, outcome: object, left: list[Credit]) -> None:
    assert outcome == offered or (isinstance(outcome, TransportError) and left == [offered]), (
        f"the credit Redis popped for the claim is lost: the claim ended {outcome!r}, and the pool holds {left}"
    )


def blocked_here(client: redis.Redis) -> set[int]:
    """The ids of the clients of this process that Redis holds blocked. The session's Redis is shared:
    other tests' claims (a batcher's BZPOPMIN) block and end meanwhile, so a count over every client
    moves without this test's claim, and stays put when one of theirs ends as the claim blocks."""
    ours = {conn.laddr.port for conn in psutil.Process().net_connections(kind="tcp") if conn.raddr}
    return {
        int(seen["id"])
        for seen in client.client_list()
        if "b" in seen["flags"] and int(seen["addr"].rsplit(":", 1)[1]) in ours
    }


@LOOPS
def test_a_credit_popped_while_the_claimer_s_loop_stalls_is_claimed_or_kept(
    run: Run, redis_url: str, names: Names, sync: redis.Redis
) -> None:
    offered = credit()

    async def scenario() -> tuple[object, list[Credit]]:
        async with credit_pool(redis_url, names) as pool:
            before = blocked_here(sync)
            claim = asyncio.create_task(pool.claim("alpha", CLAIM_S))
            await eventually(lambda: blocked_here(sync) - before, "the claim's BZPOPMIN to block")
            sync.zadd(names.credit_queue("alpha"), {encode_credit(offered): offered.idle_from_ms})  # popped at once
            time.sleep(STALL_S)  # noqa: ASYNC251  # the stall under test: the loop blocked while Redis answers
            return await ended(pool, claim)

    assert_claimed_or_kept(offered, *run(scenario()))


@LOOPS
def test_a_credit_popped_at_once_while_the_claimer_s_loop_stalls_is_claimed_or_kept(
    run: Run, primary: RedisServer, names: Names
) -> None:
    """A claim with no time left pops without blocking; its answer, behind a busy Redis, comes during the
    stall, which outlasts the command pool's socket timeout. On a Redis of the test's own (``primary``):
    the script that keeps it busy holds every command to it."""
    offered = credit()
    redis_url = primary.url

    async def scenario() -> tuple[object, list[Credit]]:
        async with credit_pool(redis_url, names) as pool:
            await pool.offer(offered)
            async with busy_redis(redis_url, BUSY_S):
                claim = asyncio.create_task(pool.claim("alpha", 0))
                for _ in range(YIELDS):
                    await asyncio.sleep(0)  # the pop is sent, and waits behind the script
                time.sleep(BUSY_S + CREDITS_POOL.socket_timeout_s)  # noqa: ASYNC251  # the stall under test
            return await ended(pool, claim)

    assert_claimed_or_kept(offered, *run(scenario()))
