"""Every pool packs commands with hiredis (redis-py does, with ``redis[hiredis]`` installed), byte for
byte as its Python packer would, whatever the URL's scheme (and a ``unix://`` URL makes a pool at all:
TCP keepalive is asked for only over TCP)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.crc import key_slot
from redis.exceptions import (
    ClusterDownError,
    DataError,
    MovedError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from infra.ports import free_port
from infra.redis_cluster import cluster_url
from schemas.records import Credit
from schemas.wire import Names
from transport.errors import PermanentTransportError
from transport.ports import TransportError
from transport.redis.credits import RedisCreditPool
from transport.redis.deliveries import RedisDeliveryLog
from transport.redis.pools import (
    KeyedClient,
    PoolOptions,
    blocking_pool,
    cluster_nodes,
    command_pool,
    is_cluster_url,
    pubsub_pool,
    redacted,
    translate,
)

PAUSE_S = 1.5
"""How long a test pauses a primary: past the pool timeout it sets, 0.5 s."""

SLOW_INCR = """
local count = redis.call('INCR', KEYS[1])
local started = redis.call('TIME')
repeat
  local now = redis.call('TIME')
until (now[1] - started[1]) * 1000000 + (now[2] - started[2]) >= tonumber(ARGV[1])
return count
"""
"""A write that runs, then holds its primary ARGV[1] microseconds before it answers."""

ARGS = ("EVALSHA", "f" * 40, 2, "bw:task:a", "bw:task:b", 86_400_000, 0.25, b"\x00avro\xff", "é", "")


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("redis://127.0.0.1:6379/0", Connection),
        ("rediss://127.0.0.1:6380/0", SSLConnection),
        ("unix:///tmp/redis.sock", UnixDomainSocketConnection),
    ],
)
def test_every_pool_packs_with_hiredis_like_redis_py(url: str, base: type[Connection]) -> None:
    pools = [
        command_pool(url, PoolOptions()),
        blocking_pool(url, 2, PoolOptions()),
        pubsub_pool(url, socket_timeout_s=1.0),
    ]
    for pool in pools:
        connection = pool.connection_class(**pool.connection_kwargs)  # as the pool makes them
        assert isinstance(connection, base)  # the scheme's class still (TLS stays TLS)
        assert connection._command_packer is not None  # hiredis's packer, not the Python one
        python_packed = b"".join(connection._pack_command_python(*ARGS))
        assert b"".join(connection.pack_command(*ARGS)) == python_packed
        # A command name with a space is split, as redis-py does ("SCRIPT LOAD" is two words).
        assert connection.pack_command("SCRIPT LOAD", "return 1") == [
            b"*3\r\n$6\r\nSCRIPT\r\n$4\r\nLOAD\r\n$8\r\nreturn 1\r\n"
        ]
        with pytest.raises(DataError):
            connection.pack_command("SET", "k", object())  # type: ignore[arg-type]


async def test_a_packed_script_call_runs(redis_url: str) -> None:
    pool = command_pool(redis_url, PoolOptions())
    redis = Redis(connection_pool=pool)
    try:
        script = redis.register_script("return {KEYS[1], ARGV[1], ARGV[2], ARGV[3]}")
        assert await script(keys=["k"], args=[b"\x00\xff", 7, "é"]) == [b"k", b"\x00\xff", b"7", "é".encode()]
    finally:
        await redis.aclose()
        await pool.disconnect()


def test_a_cluster_url_names_its_startup_nodes_and_hides_its_password() -> None:
    url = "redis+cluster://app:s3cret@10.0.0.1:7000,10.0.0.2:7001"
    nodes, user, password = cluster_nodes(url)
    assert [(node.host, node.port) for node in nodes] == [("10.0.0.1", 7000), ("10.0.0.2", 7001)]
    assert (user, password) == ("app", "s3cret")
    assert "s3cret" not in redacted(url) and "10.0.0.2:7001" in redacted(url)
    with pytest.raises(PermanentTransportError, match="is not HOST:PORT"):
        cluster_nodes("redis+cluster://10.0.0.1")


def test_a_cluster_urls_percent_encoded_credentials_are_decoded() -> None:
    """A password with a character a URL reserves (``/``, ``%``, ``,``) can only be written encoded, as
    in a ``redis://`` or ``redis+sentinel://`` URL; sent to the nodes undecoded, it never matched."""
    nodes, user, password = cluster_nodes("redis+cluster://app%3Aone:p%40ss%2Fw%2C%25@10.0.0.1:7000")
    assert [(node.host, node.port) for node in nodes] == [("10.0.0.1", 7000)]
    assert (user, password) == ("app:one", "p@ss/w,%")


def test_the_local_clusters_url_is_one_the_pools_read() -> None:
    """infra sits below transport, so it writes the scheme itself: the two must agree."""
    nodes, _, _ = cluster_nodes(cluster_url([7000, 7001]))
    assert [(node.host, node.port) for node in nodes] == [("127.0.0.1", 7000), ("127.0.0.1", 7001)]
    assert is_cluster_url(cluster_url([7000]))


async def test_a_keyed_transports_client_is_the_cluster_client_over_a_cluster_url() -> None:
    """Every transport routes each command by its key's slot."""
    over_cluster = KeyedClient("redis+cluster://127.0.0.1:7000,127.0.0.1:7001", PoolOptions())
    over_one = KeyedClient("redis://127.0.0.1:6379/0", PoolOptions())
    try:
        assert isinstance(over_cluster.redis, RedisCluster)
        assert isinstance(over_one.redis, Redis)
    finally:
        await over_cluster.close()
        await over_one.close()


async def test_a_cluster_whose_nodes_do_not_answer_fails_start_with_a_transport_error() -> None:
    client = KeyedClient(f"redis+cluster://127.0.0.1:{free_port()}", PoolOptions())
    try:
        with pytest.raises(TransportError, match="reading the slot map of the Redis Cluster at redis\\+cluster://"):
            await client.start()
    finally:
        await client.close()


def test_the_single_redis_pools_refuse_a_cluster_url() -> None:
    """They name what takes one, before anything connects."""
    with pytest.raises(PermanentTransportError, match="a Redis Cluster takes a KeyedClient"):
        command_pool("redis+cluster://127.0.0.1:7000", PoolOptions())
    with pytest.raises(PermanentTransportError, match="redis:// or redis\\+sentinel://"):
        blocking_pool("redis+cluster://127.0.0.1:7000", 2, PoolOptions())


@pytest.mark.parametrize(
    ("reply", "permanent"),
    [
        (ClusterDownError("The cluster is down"), False),
        (TryAgainError("Multiple keys request during rehashing of slot"), False),
        (MovedError("3999 127.0.0.1:6381"), False),
        (ReadOnlyError("You can't write against a read only replica."), False),
        (
            ResponseError(
                "UNBLOCKED force unblock from blocking operation, instance state changed (master -> replica?)"
            ),
            False,
        ),
        (ResponseError("NOREPLICAS Not enough good replicas to write."), False),
        (
            ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist"),
            False,
        ),
        (NoScriptError("No matching script. Please use EVAL."), False),
        (ResponseError("ERR Error running script"), True),
    ],
)
def test_a_failovers_error_replies_are_retried_a_scripts_error_is_not(reply: ResponseError, permanent: bool) -> None:
    translated = translate("storing", reply)
    assert isinstance(translated, TransportError)
    assert isinstance(translated, PermanentTransportError) is permanent, translated


def test_the_cluster_clients_own_errors_are_retried() -> None:
    """A slot no primary serves mid-failover is not a ``RedisError`` in redis-py, but is as transient."""
    translated = translate("storing", SlotNotCoveredError('Slot "0" not covered by the cluster.'))
    assert isinstance(translated, TransportError)
    assert not isinstance(translated, PermanentTransportError), translated


@pytest.mark.kafka
async def test_over_a_cluster_a_primary_that_answers_slowly_holds_up_only_its_own_commands(redis_cluster: str) -> None:
    """A command waits for a free connection to its own node: commands queued behind a paused primary
    (``CLIENT PAUSE``, a primary that answers late) leave the other primaries' commands their connections."""
    options = PoolOptions(max_connections=4, pool_timeout_s=0.5)
    keyed = KeyedClient(redis_cluster, options)
    await keyed.start()
    cluster = keyed.redis
    assert isinstance(cluster, RedisCluster)
    slow_node, other_node = cluster.get_primaries()[:2]
    keys: dict[str, list[str]] = {slow_node.name: [], other_node.name: []}
    index = 0
    while min(len(found) for found in keys.values()) < 10:
        key = f"pools-test:{index}"
        index += 1
        owner = cluster.nodes_manager.get_node_from_slot(key_slot(key.encode())).name
        if owner in keys:
            keys[owner].append(key)
    paused = Redis(host=slow_node.host, port=slow_node.port)
    try:
        await paused.execute_command("CLIENT", "PAUSE", int(PAUSE_S * 1000), "ALL")
        behind = [
            asyncio.ensure_future(cluster.get(key)) for key in keys[slow_node.name][: 2 * options.max_connections]
        ]
        await asyncio.sleep(0)  # they take the slow node's connections
        started = time.monotonic()
        elsewhere = await asyncio.gather(*(cluster.get(key) for key in keys[other_node.name]), return_exceptions=True)
        took_s = time.monotonic() - started
        await asyncio.gather(*behind, return_exceptions=True)
    finally:
        await paused.execute_command("CLIENT", "UNPAUSE")
        await paused.aclose()
        await keyed.close()
    failed = [outcome for outcome in elsewhere if isinstance(outcome, BaseException)]
    assert not failed, (
        f"{len(failed)} of {len(elsewhere)} commands to a primary that answers waited behind another: {failed[0]!r}"
    )
    assert took_s < PAUSE_S, f"the other primary's commands took {took_s:.2f} s, the slow one's pause"


@pytest.mark.kafka
async def test_a_waiter_that_leaves_in_the_turn_it_was_woken_hands_the_free_connection_on(redis_url: str) -> None:
    """A waiter for a free connection that is cancelled (its caller's timeout, its own pool timeout) in
    the turn a release woke it takes the wakeup with it on Python 3.11 (``asyncio.Condition``): the next
    waiter would wait out its pool timeout, and fail, with the connection free."""
    pool = command_pool(redis_url, PoolOptions(max_connections=1, pool_timeout_s=2.0))
    try:
        held = await pool.get_connection()
        woken = asyncio.ensure_future(pool.get_connection())
        next_one = asyncio.ensure_future(pool.get_connection())
        for _ in range(5):
            await asyncio.sleep(0)  # both wait for the connection
        releasing = asyncio.ensure_future(pool.release(held))  # its step wakes ``woken`` ...
        asyncio.get_running_loop().call_soon(woken.cancel)  # ... which leaves in the same turn
        started = time.monotonic()
        outcome = (await asyncio.gather(next_one, return_exceptions=True))[0]
        took_s = time.monotonic() - started
        await releasing
        assert not isinstance(outcome, BaseException), f"the next waiter failed after {took_s:.1f} s: {outcome}"
        assert took_s < 1.0, f"the next waiter got the free connection only after {took_s:.1f} s"
        await pool.release(outcome)
    finally:
        await pool.disconnect()


async def _key_on_a_primary(cluster: RedisCluster, prefix: str) -> tuple[str, Redis]:
    """A key of the cluster, and a plain client of the primary that holds it (no read timeout)."""
    key = f"{prefix}:{time.monotonic_ns()}"
    node = cluster.nodes_manager.get_node_from_slot(key_slot(key.encode()))
    return key, Redis(host=node.host, port=int(node.port))


@pytest.mark.kafka
async def test_over_a_cluster_a_command_to_a_paused_primary_fails_after_the_socket_timeout(redis_cluster: str) -> None:
    """As over one Redis: a primary that stops answering fails a command after the socket timeout, rather
    than holding it through the cluster client's retries for as long as the primary stays silent."""
    options = PoolOptions(socket_timeout_s=0.3)
    keyed = KeyedClient(redis_cluster, options)
    await keyed.start()
    assert isinstance(keyed.redis, RedisCluster)
    key, primary = await _key_on_a_primary(keyed.redis, "pools-test:paused")
    try:
        await primary.client_pause(4000, all=True)
        started = time.monotonic()
        with pytest.raises(RedisTimeoutError):
            await keyed.redis.get(key)
        took_s = time.monotonic() - started
    finally:
        await primary.client_unpause()
        await primary.aclose()
        await keyed.close()
    assert took_s < 2.0, f"a GET to a paused primary took {took_s:.2f} s; the socket timeout is 0.3 s"


@pytest.mark.kafka
async def test_over_a_cluster_a_write_that_timed_out_is_not_sent_again(redis_cluster: str) -> None:
    """A command that timed out may have run: sent again, a write that is not idempotent runs twice."""
    keyed = KeyedClient(redis_cluster, PoolOptions(socket_timeout_s=0.3))
    await keyed.start()
    assert isinstance(keyed.redis, RedisCluster)
    key, primary = await _key_on_a_primary(keyed.redis, "pools-test:slow-incr")
    try:
        with pytest.raises(RedisTimeoutError):
            await keyed.redis.eval(SLOW_INCR, 1, key, 600_000)
        count = await primary.get(key)  # answered once the script has run
    finally:
        await primary.delete(key)
        await primary.aclose()
        await keyed.close()
    assert count == b"1", f"a write whose answer timed out ran {count!r} times, expected once"


async def _offer(
    redis_url: str, names: Names
) -> tuple[str, Callable[[], Awaitable[object]], Callable[[], Awaitable[None]]]:
    pool = RedisCreditPool(redis_url, names, pool=PoolOptions(socket_timeout_s=0.3))
    await pool.start()
    credit = Credit(worker_id="w-paused", model="m", partition=0, seq=1, issued_at_ms=0, expires_at_ms=2**62)
    return names.credit_queue("m"), lambda: pool.offer(credit), pool.close


async def _record(
    redis_url: str, names: Names
) -> tuple[str, Callable[[], Awaitable[object]], Callable[[], Awaitable[None]]]:
    log = RedisDeliveryLog(redis_url, names, pool=PoolOptions(socket_timeout_s=0.3))
    await log.start()
    return names.delivery_record("b-paused"), lambda: log.mark("b-paused", ["t1"]), log.close


@pytest.mark.kafka
@pytest.mark.parametrize("write", [_offer, _record], ids=["credit offer", "delivery record"])
async def test_over_a_cluster_a_credit_offer_or_delivery_record_that_timed_out_is_not_sent_again(
    redis_cluster: str,
    write: Callable[
        [str, Names], Awaitable[tuple[str, Callable[[], Awaitable[object]], Callable[[], Awaitable[None]]]]
    ],
) -> None:
    """These writes are one command each, so they fail after the socket timeout as a command does; a cluster
    pipeline would send them again while the primary stays silent, and an offer landing again after a
    batcher claimed it puts the claimed credit back (two batches for one worker)."""
    names = Names(f"pools-{time.monotonic_ns()}")
    key, run, close = await write(redis_cluster, names)
    keyed = KeyedClient(redis_cluster, PoolOptions())
    await keyed.start()
    assert isinstance(keyed.redis, RedisCluster)
    node = keyed.redis.nodes_manager.get_node_from_slot(key_slot(key.encode()))
    primary = Redis(host=node.host, port=int(node.port))
    try:
        await run()  # connected, and its script loaded
        await primary.client_pause(4000, all=True)
        started = time.monotonic()
        with pytest.raises(TransportError):
            await run()
        took_s = time.monotonic() - started
    finally:
        await primary.client_unpause()
        await primary.delete(key)
        await primary.aclose()
        await keyed.close()
        await close()
    assert took_s < 2.0, f"a write to a paused primary took {took_s:.2f} s; the socket timeout is 0.3 s"
