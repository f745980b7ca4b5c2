"""A worker's credit over Redis: one at a time in the pool, even after an offer whose answer came too late."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from gpu_worker.credits import CreditOffer
from gpu_worker.runner import BackendRunner
from gpu_worker.settings import WorkerSettings
from infra.redis_server import RedisServer
from schemas.wire import Names
from tests.support.busy_redis import busy_redis
from tests.support.eventually import eventually
from tests.support.worker_rig import ScriptedBackend
from transport.memory.batches import MemoryBatchBus
from transport.redis.credits import CREDITS_POOL, RedisCreditPool
from transport.redis.pools import sync_client

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]

BUSY_S = CREDITS_POOL.socket_timeout_s + 0.5
"""How long Redis runs a script before it serves the worker's offer: past the pool's socket timeout."""


@pytest.fixture
async def pool(primary: RedisServer) -> AsyncIterator[RedisCreditPool]:
    """On a Redis of the test's own (``primary``): the script that keeps it busy holds every command to it."""
    made = RedisCreditPool(primary.url, Names(f"t{uuid.uuid4().hex[:10]}"))
    await made.start()
    yield made
    await made.close()


async def test_an_offer_whose_answer_came_too_late_is_replaced_not_doubled(
    pool: RedisCreditPool, primary: RedisServer, runner: BackendRunner
) -> None:
    settings = WorkerSettings(worker_id="w1", model="alpha")
    offers = CreditOffer(settings, pool, MemoryBatchBus(1).consumer(0), ScriptedBackend(), runner, lambda: 0.0, None)
    redis_url = primary.url
    reader = sync_client(redis_url, 5.0)
    try:
        await offers.offer()
        await offers.withdraw()  # its connection is open: the next offer is sent at once
        async with busy_redis(redis_url, BUSY_S):
            await offers.offer()  # Redis runs it once the script ends, after the client gave up on it
        key = pool.names.credit_queue("alpha")
        await eventually(lambda: reader.zcard(key) > 0, "the late offer to be stored")
        await offers.offer()
        offered = [credit.seq for credit in await pool.offered("alpha")]
    finally:
        await offers.stop()
        reader.close()
    assert len(offered) == 1, f"worker w1 has {len(offered)} credits in the pool: {offered}"
