"""Redis behind Sentinel: the URL form, the transports over it, and the same objects after a failover.

The servers are real (``sentinels.SentinelCluster``: a primary, a replica, three Sentinels on
loopback). The failover test kills the primary, so it runs last in this module.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.sentinel import SentinelManagedConnection

from batchwire.gateway_transports import redis_readiness
from batchwire.settings import SettingsError, SharedSettings
from gateway.health import Down
from infra.ports import free_port
from schemas.records import Credit, TaskState, TaskStatus
from schemas.wire import Names
from tests.support.eventually import eventually, eventually_sync
from tests.support.sentinels import FAILOVER_WAIT_S, MASTER, HeldSentinel, SentinelCluster
from tests.support.task_states import state
from transport.errors import PermanentTransportError
from transport.ports import TransportError
from transport.redis.credits import RedisCreditPool
from transport.redis.pools import PoolOptions, blocking_pool, command_pool, follower_of, pubsub_pool, redacted
from transport.redis.sentinel import (
    DEFAULT_SENTINEL_PORT,
    SentinelError,
    SentinelPool,
    SentinelUrl,
    check_sentinels,
    parse_sentinel_url,
    primary_follower,
    sentinel_pool,
)
from transport.redis.store import RedisTaskStore

pytestmark = pytest.mark.timeout(90)

T = TypeVar("T")


# (a) the URL form


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "redis+sentinel://10.0.0.1:26379,10.0.0.2:26380/batchwire/2",
            SentinelUrl((("10.0.0.1", 26379), ("10.0.0.2", 26380)), "batchwire", 2),
        ),
        ("redis+sentinel://s1/primary", SentinelUrl((("s1", DEFAULT_SENTINEL_PORT),), "primary", 0)),
        ("redis+sentinel://[::1]:5000/m/", SentinelUrl((("::1", 5000),), "m", 0)),
        (
            "REDIS+SENTINEL://app:p%40ss@h:1/my%20master/0",
            SentinelUrl((("h", 1),), "my master", 0, username="app", password="p@ss"),
        ),
        ("redis+sentinel://:secret@h:1/m", SentinelUrl((("h", 1),), "m", 0, password="secret")),
    ],
)
def test_a_sentinel_url_names_sentinels_master_db_and_credentials(url: str, expected: SentinelUrl) -> None:
    assert parse_sentinel_url(url) == expected


@pytest.mark.parametrize(
    ("url", "wrong"),
    [
        ("redis+sentinel://h:1", "no master name"),
        ("redis+sentinel:///m", "no Sentinel address"),
        ("redis+sentinel://h:1,,h:2/m", "no Sentinel address"),
        ("redis+sentinel://h:port/m", "the port in Sentinel address 'h:port'"),
        ("redis+sentinel://h:70000/m", "the port in Sentinel address 'h:70000'"),
        ("redis+sentinel://[::1/m", "is not [IPv6]:PORT"),
        ("redis+sentinel://h:1/m/one", "the DB 'one' is not a number"),
        ("redis+sentinel://h:1/m/0/x", "'x' follows the DB number"),
        ("redis+sentinel://h:1/m?ssl=true", "query options"),
    ],
)
def test_a_malformed_sentinel_url_says_which_part_is_wrong_and_the_form(url: str, wrong: str) -> None:
    with pytest.raises(SentinelError) as raised:
        parse_sentinel_url(url)
    message = str(raised.value)
    assert wrong in message, message
    assert "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB]" in message, message


def test_passwords_stay_out_of_messages() -> None:
    assert redacted("redis+sentinel://app:hunter2@h:1,h:2/m/0") == "redis+sentinel://app:***@h:1,h:2/m/0"
    with pytest.raises(SentinelError) as raised:
        parse_sentinel_url("redis+sentinel://app:hunter2@h:1/m/x")
    assert "hunter2" not in str(raised.value)


@pytest.mark.parametrize(
    "url",
    ["redis+sentinel://app:Qz7/Xk9@h:1/m/0", "redis+cluster://app:Qz7/Xk9@h:1,h:2", "redis://app:Qz7/Xk9@h:1/0"],
)
def test_a_password_written_unencoded_with_a_slash_stays_out_of_messages(url: str) -> None:
    """A ``/`` in the password ends the URL's authority there, so such a URL is malformed, and the role's
    message quotes it: its part after the ``/`` was quoted with the hosts, its start as a bad address."""
    assert "Qz7" not in redacted(url) and "Xk9" not in redacted(url), redacted(url)
    with pytest.raises((SettingsError, PermanentTransportError)) as raised:
        SharedSettings(redis_url=url).require_redis()
    assert "Qz7" not in str(raised.value) and "Xk9" not in str(raised.value), str(raised.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://app:Qz7?Xk9@127.0.0.1:1/0",
        "rediss://app:Qz7/X?k9@127.0.0.1:1/0",
        "redis+sentinel://app:Qz7?Xk9@127.0.0.1:1/m/0",
        "redis+cluster://app:Qz7?Xk9@127.0.0.1:1,127.0.0.1:2",
        "redis://:Qz7?Xk9@127.0.0.1:1/0?password=Qz7Xk9&db=0",
    ],
)
def test_a_password_written_unencoded_with_a_question_mark_stays_out_of_messages(url: str) -> None:
    """A ``?`` in the password starts the URL's query there: its part before the ``?`` was quoted as the
    address and the rest as a query option, the password whole in the role's message."""
    assert "Qz7" not in redacted(url) and "Xk9" not in redacted(url), redacted(url)
    with pytest.raises((SettingsError, PermanentTransportError)) as raised:
        SharedSettings(redis_url=url).require_redis()
    assert "Qz7" not in str(raised.value) and "Xk9" not in str(raised.value), str(raised.value)


@pytest.mark.parametrize("url", ["sentinel://h:1,h:2/m", "http://h:1/0"])
def test_a_scheme_redis_does_not_take_is_a_settings_error(url: str) -> None:
    with pytest.raises(SettingsError, match=r"the scheme must be one of .*redis\+sentinel://"):
        SharedSettings(redis_url=url).require_redis()


def test_a_cluster_url_whose_nodes_do_not_answer_stops_a_role_naming_the_setting() -> None:
    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    with pytest.raises(SettingsError, match=r"did not answer .*--redis-url / BATCHWIRE_REDIS_URL"):
        SharedSettings(redis_url=url).require_redis()


@pytest.mark.kafka
def test_a_cluster_url_whose_nodes_answer_is_taken(redis_cluster: str) -> None:
    assert SharedSettings(redis_url=redis_cluster).require_redis() == redis_cluster


# Real servers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelCluster]:
    servers = SentinelCluster(Path(tmp_path_factory.mktemp("sentinel")))
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()


@pytest.mark.kafka
def test_start_up_check_finds_the_primary_or_names_the_masters_the_sentinels_know(cluster: SentinelCluster) -> None:
    assert check_sentinels(cluster.url) == ("127.0.0.1", cluster.primary_port)
    assert SharedSettings(redis_url=cluster.url).require_redis() == cluster.url

    unknown = cluster.url.replace(f"/{MASTER}/", "/nosuch/")
    with pytest.raises(SettingsError) as raised:
        SharedSettings(redis_url=unknown).require_redis()
    message = str(raised.value)
    assert f"know no master named 'nosuch'; they know: '{MASTER}'" in message, message
    assert "BATCHWIRE_REDIS_URL" in message, message


@pytest.mark.kafka
async def test_an_address_that_answers_sentinel_with_an_error_is_passed_over_as_at_start(
    cluster: SentinelCluster,
) -> None:
    """A server at a Sentinel's address that is no Sentinel (here a Redis, which answers ``SENTINEL
    MASTERS`` with ``ERR unknown command``) is passed over by the start-up check; every lookup of a
    pool's connection, and every round of its follower, asks it first and must pass it over too."""
    hosts = ",".join(f"127.0.0.1:{port}" for port in [cluster.primary_port, *cluster.sentinel_ports])
    url = f"redis+sentinel://{hosts}/{MASTER}/0"
    assert check_sentinels(url) == ("127.0.0.1", cluster.primary_port)
    pool = sentinel_pool(url, socket_connect_timeout=5.0)
    client = Redis(connection_pool=pool)
    try:
        assert await client.set("error-answering-sentinel-probe", "1", ex=10)
        assert await pool.sentinel_manager.discover_master(MASTER) == ("127.0.0.1", cluster.primary_port)
    finally:
        await client.aclose()
        await pool.disconnect()


# (b) the transports over a Sentinel URL


@pytest.mark.kafka
async def test_every_pool_kind_is_sentinel_managed(cluster: SentinelCluster) -> None:
    options = PoolOptions()
    pools: list[ConnectionPool] = [command_pool(cluster.url, options), blocking_pool(cluster.url, 1, options)]
    pools.append(pubsub_pool(cluster.url, socket_timeout_s=1.0))
    try:
        for pool in pools:
            assert isinstance(pool, SentinelPool), pool
            assert issubclass(pool.connection_class, SentinelManagedConnection), pool.connection_class
        assert isinstance(pools[0], BlockingConnectionPool)
        assert isinstance(pools[1], BlockingConnectionPool)
        assert await Redis(connection_pool=pools[0]).set("sentinel-pool-probe", "1", ex=10)
    finally:
        for pool in pools:
            await pool.disconnect()


@pytest.mark.kafka
async def test_task_store_and_credit_pool_work_over_a_sentinel_url(cluster: SentinelCluster, names: Names) -> None:
    store = RedisTaskStore(cluster.url, names, ttl_s=60)
    credits = RedisCreditPool(cluster.url, names)
    await store.start()
    await credits.start()
    try:
        queued = state("t1", TaskStatus.QUEUED)
        assert await store.create(queued)
        async with store.watch("t1") as events:
            assert await store.apply([state("t1", TaskStatus.RUNNING)]) == [True]
            seen = await asyncio.wait_for(anext(events), 5)
        assert seen.status is TaskStatus.RUNNING
        stored = await store.get("t1")
        assert stored is not None
        assert stored.status is TaskStatus.RUNNING

        now_ms = int(time.time() * 1000)
        credit = Credit("w1", "alpha", 0, 1, now_ms, now_ms + 60_000)
        await credits.offer(credit)
        assert await credits.idle("alpha") == 1
        assert await credits.claim("alpha", timeout_s=2) == credit
    finally:
        await credits.close()
        await store.close()

    primary = Redis(port=cluster.primary_port)
    try:
        assert await primary.hget(names.task_key("t1"), "status") == b"running", "the writes went to the primary"
    finally:
        await primary.aclose()


@pytest.mark.kafka
async def test_confirming_the_primary_asks_each_sentinel_once_though_a_lookup_reorders_them(
    cluster: SentinelCluster,
) -> None:
    """A lookup (``discover_master``, as the pool's follower runs it) moves the Sentinel that answered to
    the front of the list, in place. ``confirm_primary`` went through that list one by one, awaiting
    each: a reorder meanwhile made it ask the silent Sentinel twice and skip one that answers, so two
    of four answered and it confirmed nothing."""
    silent = HeldSentinel()
    await silent.start()
    hosts = ",".join(f"127.0.0.1:{port}" for port in [silent.port, *cluster.sentinel_ports])
    pool = sentinel_pool(f"redis+sentinel://{hosts}/{MASTER}/0", socket_connect_timeout=5.0)
    try:
        confirming = asyncio.create_task(pool.confirm_primary())
        await asyncio.wait_for(silent.holding.wait(), 10)  # it waits on the silent Sentinel
        primary = await pool.sentinel_manager.discover_master(MASTER)  # its retries are closed at once
        assert primary == ("127.0.0.1", cluster.primary_port)
        front = pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs["port"]
        assert front == cluster.sentinel_ports[0], f"the lookup moved no answering Sentinel to the front: {front}"
        silent.release()
        assert await asyncio.wait_for(confirming, 10), "three of four Sentinels name the primary: it is confirmed"
    finally:
        await pool.disconnect()
        await silent.close()


# (c) a graceful failover: the old primary stays up, and takes writes, until the Sentinels demote it

FOLLOW_BOUND_S = 3.0
"""How soon after every Sentinel names the promoted replica the pools' connections must follow it."""


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[SentinelCluster]:
    """Servers for one test that swaps their roles or stops one, leaving the module's ``cluster`` as it was."""
    servers = SentinelCluster(tmp_path)
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()


COUNT_BOUND_S = 3.0
"""How long counting a primary's replicas may take with one Sentinel silent: a count that waits for the
silent one pays at least its timeout, and one that does not takes a round trip to Redis."""


@pytest.mark.kafka
async def test_a_silent_sentinel_costs_no_wait_to_count_a_primarys_replicas(
    own_cluster: SentinelCluster, names: Names
) -> None:
    """A worker counts the primary's replicas (``connected_replicas``) before it stores a batch's results,
    and again at least every 10 s. The Sentinels' confirmation that the server is the
    primary, which waits for every Sentinel, matters only when the count is none (an old primary that
    lost its replica); a count of one or more is asked for as it is. A silent Sentinel (hung, cut off)
    held each count for its whole timeout: each worker's results waited that long every recount."""
    own_cluster.pause(own_cluster.sentinel_ports[-1])  # last: the store's lookups never ask it
    store = RedisTaskStore(own_cluster.url, names, ttl_s=60, pool=PoolOptions(socket_timeout_s=COUNT_BOUND_S * 3))
    primary = Redis(port=own_cluster.primary_port)
    try:
        await store.start()
        # A replica that timed out under a loaded machine resyncs, and reads as no replica meanwhile: that
        # count rightly asks the Sentinels. Counted here is one in sync, as it is at the count's start.
        await _until_replica_online(primary, timeout_s=30)
        started = time.monotonic()
        assert await store.connected_replicas() == 1, "the replica, in sync, is counted"
        took_s = time.monotonic() - started
        assert took_s < COUNT_BOUND_S, f"counting the replicas took {took_s:.1f} s: it waited for the silent Sentinel"
    finally:
        own_cluster.resume(own_cluster.sentinel_ports[-1])
        await store.close()
        await primary.aclose()


async def _until_replica_online(primary: Redis, timeout_s: float) -> None:
    """Waits until ``primary`` counts its replica connected and in sync (``online``)."""
    deadline = time.monotonic() + timeout_s
    while (await primary.info("replication")).get("slave0", {}).get("state") != "online":
        assert time.monotonic() < deadline, f"the primary's replica is not in sync after {timeout_s} s"
        await asyncio.sleep(0.05)


@pytest.mark.kafka
async def test_readiness_says_failing_over_while_the_sentinels_see_the_primary_down(tmp_path: Path) -> None:
    """With no replica to promote, the Sentinels hold a killed primary down for good, so /readyz's
    "failing over" can be read without racing a promotion that ends in well under a second."""
    servers = SentinelCluster(tmp_path, replicas=0)
    try:
        servers.start()
        where = f"127.0.0.1:{servers.primary_port}"
        assert await redis_readiness(True, servers.url, 1.0) is True
        settled = await redis_readiness(False, servers.url, 1.0)
        assert isinstance(settled, Down) and settled.state == "down", settled
        assert where in settled.reason and "does not answer" in settled.reason, settled

        servers.kill(servers.primary_port)
        deadline = time.monotonic() + FAILOVER_WAIT_S
        while (ready := await redis_readiness(False, servers.url, 1.0)) == settled:
            assert time.monotonic() < deadline, f"the Sentinels never saw {where} down: {ready}"
            await asyncio.sleep(0.05)
        assert isinstance(ready, Down) and ready.state == "failing over", ready
        assert where in ready.reason and "promoting a replica" in ready.reason, ready
    finally:
        servers.stop()


async def _promoted(cluster: SentinelCluster, what: str) -> None:
    """Waits until the Sentinels name the replica primary."""
    promoted = ("127.0.0.1", cluster.replica_port)
    await asyncio.to_thread(eventually_sync, lambda: cluster.master_address() == promoted, what, timeout_s=30)


async def demoted(old: Redis, new_port: int) -> bool:
    """The old primary is a replica of the promoted one and has copied it (dropping its own writes)."""
    info = await old.info("replication")
    return (
        info.get("role") == "slave" and info.get("master_port") == new_port and info.get("master_link_status") == "up"
    )


@pytest.mark.kafka
async def test_after_a_graceful_failover_no_write_the_store_accepts_is_lost(
    own_cluster: SentinelCluster, names: Names
) -> None:
    cluster = own_cluster
    # As a role builds it: its pools (commands, change feed) follow the primary through one follower.
    store = RedisTaskStore(cluster.url, names, ttl_s=120, follower=follower_of(cluster.url))
    await store.start()
    old, new = Redis(port=cluster.primary_port), Redis(port=cluster.replica_port)
    sentinel = Redis(port=cluster.sentinel_ports[0])
    accepted: list[tuple[float, str]] = []
    try:
        assert await store.create(state("before", TaskStatus.QUEUED))  # the pool's connection opens to the primary
        assert await old.wait(1, 5000) == 1, "the replica must hold 'before' when it is promoted"
        assert await sentinel.execute_command("SENTINEL", "FAILOVER", MASTER)
        await _promoted(cluster, "the Sentinels to promote the replica")
        switched_at = time.monotonic()
        # Writes through the same store, paced, until the Sentinels demote the old primary and it copies
        # the new one: whatever the old primary took by then is gone.
        index = 0
        while not await demoted(old, cluster.replica_port):
            assert time.monotonic() - switched_at < 60, "the Sentinels did not demote the old primary in 60 s"
            task_id = f"after-{index}"
            index += 1
            try:
                if await store.create(state(task_id, TaskStatus.QUEUED)):
                    accepted.append((time.monotonic() - switched_at, task_id))
            except TransportError:
                pass  # the demotion closes the old primary's connections: refused, not accepted
            await asyncio.sleep(0.05)
    finally:
        await store.close()
    try:
        kept = {task_id for _, task_id in accepted if await new.exists(names.task_key(task_id))}
    finally:
        for client in (old, new, sentinel):
            await client.aclose()
    late = [(round(at, 2), task_id) for at, task_id in accepted if at >= FOLLOW_BOUND_S]
    lost = [item for item in late if item[1] not in kept]
    assert late, "no write was accepted after the pools had time to follow the promoted replica"
    assert not lost, (
        f"{len(lost)} of {len(late)} writes accepted {FOLLOW_BOUND_S:g} s or more after every Sentinel named the "
        f"promoted replica were lost (seconds after the switch, task): {lost[:5]}"
    )


@pytest.mark.kafka
async def test_a_pool_closes_every_connection_to_a_cut_off_primary_though_no_close_finishes(
    own_cluster: SentinelCluster,
) -> None:
    """A primary cut off (here stopped) with writes in flight never takes the rest of them, so a close
    that waits for them to go out times out (redis-py raises TimeoutError). That error ended the pool's
    follower for good, after closing one connection: the others stayed on the old primary."""
    cluster = own_cluster
    # A write waits longer than the test: only the pool's follower closes the connections.
    pool = sentinel_pool(cluster.url, socket_timeout=60, socket_connect_timeout=0.5, client_name="cut-off")
    connections = [await pool.get_connection() for _ in range(3)]
    assert {(conn.host, conn.port) for conn in connections} == {("127.0.0.1", cluster.primary_port)}
    value = b"x" * (32 << 20)  # more than the sockets' kernel buffers hold: the rest waits in the connection's
    command = [b"*3\r\n$3\r\nSET\r\n$5\r\nlarge\r\n$%d\r\n" % len(value), value, b"\r\n"]
    cluster.pause(cluster.primary_port)
    writes = [asyncio.create_task(conn.send_packed_command(command, check_health=False)) for conn in connections]
    try:
        await _promoted(cluster, "the Sentinels to promote the replica of the stopped primary")
        await eventually(
            lambda: not any(conn.is_connected for conn in connections),
            "the pool to close all its connections to the stopped primary",
            timeout_s=FOLLOW_BOUND_S,
        )
    finally:
        cluster.resume(cluster.primary_port)
        await asyncio.wait_for(asyncio.gather(*writes, return_exceptions=True), 30)  # it reads them now
        for conn in connections:
            await pool.release(conn)
        await pool.disconnect()
        await asyncio.to_thread(  # the sockets closed without waiting are closed once their writes went out
            eventually_sync,
            lambda: not cluster.clients(cluster.primary_port, "cut-off"),
            "the old primary to see the pool's connections closed",
            timeout_s=30,
        )


@pytest.mark.kafka
async def test_pools_sharing_a_follower_all_follow_a_graceful_failover_past_a_silent_sentinel(
    own_cluster: SentinelCluster,
) -> None:
    """A process's pools share one follower (``follower_of``): each lookup of it moves every pool's
    connections, and a Sentinel that never answers, listed first, holds its first lookup for its
    timeout only; the Sentinel that answered is asked first from then on."""
    cluster = own_cluster
    silent = HeldSentinel()
    await silent.start()
    hosts = ",".join(f"127.0.0.1:{port}" for port in [silent.port, *cluster.sentinel_ports])
    url = f"redis+sentinel://{hosts}/{MASTER}/0"
    follower = primary_follower(url, timeout_s=1.0)
    options = PoolOptions(socket_timeout_s=1.0)
    pools = [command_pool(url, options, follower), blocking_pool(url, 1, options, follower)]
    sentinel = Redis(port=cluster.sentinel_ports[0])
    try:
        follower.join(pools[0])  # as the pool's first connection does, here before the pools' own lookups
        await asyncio.wait_for(silent.holding.wait(), 10)  # the follower's first lookup waits on the silent one
        connections = [await pool.get_connection() for pool in pools]
        assert {(conn.host, conn.port) for conn in connections} == {("127.0.0.1", cluster.primary_port)}
        assert await sentinel.execute_command("SENTINEL", "FAILOVER", MASTER)
        await _promoted(cluster, "the Sentinels to promote the replica")
        await eventually(
            lambda: not any(conn.is_connected for conn in connections),
            "the shared follower to close both pools' connections to the old primary",
            timeout_s=FOLLOW_BOUND_S,
        )
        for pool, conn in zip(pools, connections, strict=True):
            await pool.release(conn)
        again = [await pool.get_connection() for pool in pools]
        assert {(conn.host, conn.port) for conn in again} == {("127.0.0.1", cluster.replica_port)}
        for pool, conn in zip(pools, again, strict=True):
            await pool.release(conn)
    finally:
        for pool in pools:
            await pool.disconnect()
        await sentinel.aclose()
        await silent.close()


@pytest.mark.kafka
async def test_writes_a_primary_refuses_for_want_of_replicas_are_retried_and_go_through_once_it_takes_them(
    own_cluster: SentinelCluster, names: Names
) -> None:
    """A primary run with ``min-replicas-to-write 1`` (operations.md's way to close the graceful
    failover's window) answers ``NOREPLICAS`` to every write while its replica is down. That refusal
    ends when the replica is back: a role retries it rather than stop (it was read as permanent, and
    a batcher's claim or a worker's stored results ended the process with exit 1)."""
    cluster = own_cluster
    follower = follower_of(cluster.url)
    store = RedisTaskStore(cluster.url, names, ttl_s=60, follower=follower)
    credits = RedisCreditPool(cluster.url, names, follower=follower)
    primary = Redis(port=cluster.primary_port)
    await store.start()
    await credits.start()
    try:
        await primary.config_set("min-replicas-to-write", 1)
        await _until_good_replicas(primary, 1, timeout_s=10)  # a replica still syncing is not counted yet
        assert await store.create(state("before", TaskStatus.QUEUED))
        cluster.kill(cluster.replica_port)
        await _until_no_replica(primary, timeout_s=10)
        now_ms = int(time.time() * 1000)
        credit = Credit("w1", "alpha", 0, 1, now_ms, now_ms + 60_000)
        refusals: list[Callable[[], Awaitable[object]]] = [
            lambda: store.create(state("during", TaskStatus.QUEUED)),
            lambda: store.apply([state("before", TaskStatus.COMPLETED, output="ok")]),
            lambda: credits.offer(credit),
            lambda: credits.claim("alpha", timeout_s=0.5),
        ]
        for refused in refusals:
            with pytest.raises(TransportError) as raised:
                await refused()
            assert "NOREPLICAS" in str(raised.value), raised.value
            assert not isinstance(raised.value, PermanentTransportError), (
                f"a primary short of replicas takes writes again once they are back; expected a transient "
                f"TransportError, got {raised.value!r}"
            )

        await primary.config_set("min-replicas-to-write", 0)  # as the replica's return does
        assert await store.create(state("during", TaskStatus.QUEUED))
        assert await store.apply([state("before", TaskStatus.COMPLETED, output="ok")]) == [True]
        await credits.offer(credit)
        assert await credits.claim("alpha", timeout_s=2) == credit
    finally:
        await credits.close()
        await store.close()
        await primary.aclose()


async def _until_good_replicas(primary: Redis, count: int, timeout_s: float) -> None:
    """Waits until ``primary`` counts ``count`` replicas good for ``min-replicas-to-write`` (online, and
    acknowledged within ``min-replicas-max-lag``): until then it refuses writes."""
    deadline = time.monotonic() + timeout_s
    while int((await primary.info("replication")).get("min_slaves_good_slaves", 0)) < count:
        assert time.monotonic() < deadline, f"the primary counts fewer than {count} good replicas after {timeout_s} s"
        await asyncio.sleep(0.05)


async def _until_no_replica(primary: Redis, timeout_s: float) -> None:
    """Waits until ``primary`` counts no connected replica (it sees the killed one's socket close)."""
    deadline = time.monotonic() + timeout_s
    while int((await primary.info("replication"))["connected_slaves"]) > 0:
        assert time.monotonic() < deadline, f"the primary still counts a replica after {timeout_s} s"
        await asyncio.sleep(0.05)


# (d) a failover under the same objects (kills the primary: keep this test last)


async def retrying(action: Callable[[], Awaitable[T]], what: str, timeout_s: float = FAILOVER_WAIT_S) -> T:
    """``action`` until it stops raising ``TransportError`` (the failover), bounded by ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await action()
        except TransportError as err:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} still failing after {timeout_s} s: {err}") from err
            await asyncio.sleep(0.1)


async def until_running(events: AsyncIterator[TaskState]) -> list[TaskState]:
    """The states a watcher sees up to ``running`` (the re-read after a reconnect may come first)."""
    seen: list[TaskState] = []
    async for event in events:
        seen.append(event)
        if event.status is TaskStatus.RUNNING:
            break
    return seen


@pytest.mark.kafka
async def test_the_same_store_follows_a_failover_to_the_promoted_replica(
    cluster: SentinelCluster, names: Names
) -> None:
    store = RedisTaskStore(cluster.url, names, ttl_s=60, ping_interval_s=0.5)
    credits = RedisCreditPool(cluster.url, names)
    await store.start()
    await credits.start()
    replies: asyncio.Queue[TaskState] = asyncio.Queue()
    try:
        await store.listen_replies("g1", replies.put_nowait)
        assert await store.create(state("before", TaskStatus.QUEUED, reply_to="g1"))
        primary = Redis(port=cluster.primary_port)
        try:
            assert await primary.wait(1, 5000) == 1, "the replica must hold 'before' when the primary dies"
        finally:
            await primary.aclose()

        async with store.watch("before") as events:  # the change feed, held across the failover
            cluster.kill(cluster.primary_port)
            await _promoted(cluster, "the Sentinels to promote the replica")

            # A write, a read, and a reply through the re-made PubSub subscription, all on the new primary.
            assert await retrying(lambda: store.create(state("after", TaskStatus.QUEUED, reply_to="g1")), "create")
            got = await retrying(lambda: store.get("before"), "get")
            assert got is not None
            assert got.status is TaskStatus.QUEUED
            await eventually(store.reachable, "the PubSub connection to reconnect to the new primary", timeout_s=20)
            assert await retrying(lambda: store.apply([state("before", TaskStatus.RUNNING)]), "apply") == [True]
            seen = await asyncio.wait_for(until_running(events), 10)
            assert seen[-1].status is TaskStatus.RUNNING, f"the watcher saw {seen}"
        done = state("after", TaskStatus.COMPLETED, output="ok", reply_to="g1")
        assert await retrying(lambda: store.apply([done]), "apply") == [True]
        reply = await asyncio.wait_for(replies.get(), 10)
        assert (reply.task_id, reply.status) == ("after", TaskStatus.COMPLETED)
        assert store.reconnects >= 1

        now_ms = int(time.time() * 1000)
        credit = Credit("w1", "alpha", 0, 2, now_ms, now_ms + 60_000)
        await retrying(lambda: credits.offer(credit), "offer")
        assert await retrying(lambda: credits.claim("alpha", timeout_s=2), "claim") == credit
    finally:
        await credits.close()
        await store.close()

    new_primary = Redis(port=cluster.replica_port)
    try:
        assert await new_primary.hget(names.task_key("after"), "status") == b"completed"
    finally:
        await new_primary.aclose()
