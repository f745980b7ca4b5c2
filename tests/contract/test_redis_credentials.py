"""A Redis whose password changes while the roles run (``CONFIG SET requirepass``, an ACL user's): each
refused command and each refused PubSub reconnect says what to change, and the roles work again,
without a restart, once the server takes their credentials again."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import redis
from redis.asyncio import ConnectionPool

from infra.redis_server import RedisServer
from schemas.records import TaskState, TaskStatus
from schemas.wire import Names
from tests.support.eventually import eventually
from transport.ports import TransportError
from transport.redis.pools import CREDENTIALS_ADVICE
from transport.redis.pubsub import PubSubHub
from transport.redis.store import RedisTaskStore

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]

PASSWORD = "rotated"


def _require_password(url: str) -> redis.Redis:
    """Sets ``requirepass`` and drops every other connection, as a restart with the new setting would;
    returns an authenticated client to undo it."""
    client = redis.Redis.from_url(url)
    client.config_set("requirepass", PASSWORD)
    client.close()
    admin = redis.Redis.from_url(url, password=PASSWORD)
    admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    return admin


async def test_a_refused_password_names_the_setting_to_change_and_the_store_works_once_it_is_taken(
    primary: RedisServer, names: Names, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="transport.redis.pubsub")
    store = RedisTaskStore(primary.url, names)
    await store.start()
    try:
        now_ms = int(time.time() * 1000)
        await store.create(TaskState("before", TaskStatus.QUEUED, "sim", now_ms, now_ms))
        admin = _require_password(primary.url)
        try:
            with pytest.raises(TransportError) as refused:
                await store.get("before")
            assert CREDENTIALS_ADVICE in str(refused.value), f"the error says what to change: {refused.value}"
            assert refused.value.retriable, "a role waits for its credentials to be taken again, it does not stop"
            with pytest.raises(TransportError, match="--redis-url / BATCHWIRE_REDIS_URL"):
                await store.create(TaskState("during", TaskStatus.QUEUED, "sim", now_ms, now_ms))

            def reconnect_refused_with_advice() -> bool:
                return any(
                    "PubSub reconnect failed" in record.getMessage() and CREDENTIALS_ADVICE in record.getMessage()
                    for record in caplog.records
                )

            await eventually(reconnect_refused_with_advice, "the change feed's refused reconnect to say what to change")
        finally:
            admin.config_set("requirepass", "")
            admin.close()
        await eventually(store.reachable, "the change feed to reconnect once the password is taken")
        state = await store.get("before")
        assert state is not None and state.status is TaskStatus.QUEUED, state
    finally:
        await store.close()


def _ignore(*_: Any) -> None:
    return None


async def _ignore_async(*_: Any) -> None:
    return None


async def test_a_refused_pubsub_reconnect_is_logged_once_in_twenty_tries_not_at_each(
    primary: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis that refuses the change feed for as long as an operator takes to fix its password would
    log a line at each reconnect (twice a second per process); the roles' other retries log the first
    failure and every 20th (``transport.retry.pause``)."""
    caplog.set_level(logging.WARNING, logger="transport.redis.pubsub")
    pool = ConnectionPool.from_url(primary.url)
    hub = PubSubHub(pool, _ignore, _ignore_async, _ignore, min_backoff_s=0.001, max_backoff_s=0.005)
    await hub.start()
    try:
        admin = _require_password(primary.url)
        try:
            await eventually(lambda: hub.failed_reconnects >= 45, "45 refused reconnects")
        finally:
            admin.config_set("requirepass", "")
            admin.close()
        await eventually(lambda: hub.reconnects == 1, "the hub to reconnect once the password is taken")
        failed = hub.failed_reconnects
        logged = [record.getMessage() for record in caplog.records if "reconnect failed" in record.getMessage()]
        assert 1 <= len(logged) <= 1 + failed // 20, f"{len(logged)} lines for {failed} refused reconnects"
        assert "1 tries so far" in logged[0] and CREDENTIALS_ADVICE in logged[0], logged[0]
    finally:
        await hub.close()
        await pool.aclose()
