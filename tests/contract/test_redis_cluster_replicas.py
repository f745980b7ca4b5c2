"""Writes that wait for replicas over a Redis Cluster: ``WAIT`` per primary, on the connection that wrote.

Over the session's cluster of three primaries, each with a replica (``replicated_cluster``), and over
the one without replicas (``redis_cluster``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from infra.redis_cluster import LocalRedisCluster
from infra.redis_server import CLUSTER_BUS_OFFSET, RedisServer
from schemas.codec import decode_state
from schemas.records import TaskState, TaskStatus
from schemas.wire import Names
from tests.support.eventually import eventually
from transport.ports import TransportError
from transport.redis.pools import PoolOptions, cluster_client
from transport.redis.pubsub import ShardedHubs
from transport.redis.store import STORE_POOL, RedisTaskStore

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]

WAIT_MS = 2_000
FROZEN_TRIES = 40
"""Writes of a frozen primary's slots, each failing after the socket timeout (0.5 s), tried until its
replica takes over (the cluster's node timeout, 2 s, and an election): about 25 s of tries."""


@pytest.fixture
def names() -> Names:
    return Names(f"wait-{uuid.uuid4().hex[:8]}")


@pytest.fixture
async def store(replicated_cluster: Any, names: Names) -> AsyncIterator[RedisTaskStore]:
    store = RedisTaskStore(replicated_cluster.url, names)
    await store.start()
    try:
        yield store
    finally:
        await store.close()


def state(task_id: str, status: TaskStatus, **fields: Any) -> TaskState:
    return TaskState(task_id, status, "sim", time.time_ns() // 1_000_000 + status.rank, 0, **fields)


def replicas_of(cluster: Any) -> list[redis.Redis]:
    """A client per replica node, reading (``READONLY``) the keys of the slots its primary serves."""
    clients = []
    for node in cluster.nodes:
        client = redis.Redis(port=node.port)
        if client.info("replication")["role"] == "slave":
            client.execute_command("READONLY")
            clients.append(client)
        else:
            client.close()
    return clients


async def test_every_primary_counts_its_replica(store: RedisTaskStore, redis_cluster: str, names: Names) -> None:
    assert await store.connected_replicas() == 1
    bare = RedisTaskStore(redis_cluster, names)
    await bare.start()
    try:
        assert await bare.connected_replicas() == 0, "a cluster without replicas has none to wait for"
    finally:
        await bare.close()


async def test_a_batch_over_every_primary_is_on_their_replicas_when_wait_answers(
    store: RedisTaskStore, replicated_cluster: Any, names: Names
) -> None:
    """Forty tasks fall on all three primaries; each primary's pipeline writes its share, a mark and
    ``WAIT``, and the replies still reach their gateway's channel."""
    ids = [f"t{n}-{uuid.uuid4().hex[:6]}" for n in range(40)]
    for task_id in ids:
        assert await store.create(state(task_id, TaskStatus.QUEUED, reply_to="g1"))
    replies: list[TaskState] = []
    all_in = asyncio.Event()

    def on_reply(reply: TaskState) -> None:
        replies.append(reply)
        if len(replies) == len(ids):
            all_in.set()

    await store.listen_replies("g1", on_reply)
    done = [state(task_id, TaskStatus.COMPLETED, output=task_id[::-1], reply_to="g1") for task_id in ids]

    acked = await store.apply_replicated(done, 1, WAIT_MS)

    assert acked == 1, "every primary's replica acknowledged its share"
    await asyncio.wait_for(all_in.wait(), 5)
    assert sorted(reply.task_id for reply in replies) == sorted(ids), "one reply per task, on the gateway's channel"
    on_replicas: dict[str, TaskState] = {}
    for client in replicas_of(replicated_cluster):
        with client:
            for task_id in ids:
                try:
                    doc = client.hget(names.task_key(task_id), "doc")
                except redis.exceptions.MovedError:
                    continue  # another primary's slot
                if doc is not None:
                    on_replicas[task_id] = decode_state(doc)
    assert {task_id: s.status for task_id, s in on_replicas.items()} == dict.fromkeys(ids, TaskStatus.COMPLETED), (
        "WAIT answered: each task's end is on its primary's replica"
    )


async def test_a_mark_in_the_tasks_slot_makes_wait_cover_an_update_already_applied(
    store: RedisTaskStore, replicated_cluster: Any, names: Names
) -> None:
    task_id = f"again-{uuid.uuid4().hex[:6]}"
    await store.create(state(task_id, TaskStatus.QUEUED))
    completed = state(task_id, TaskStatus.COMPLETED, output="x")
    assert await store.apply([completed]) == [True]

    assert await store.apply_replicated([completed], 1, WAIT_MS) == 1
    marks = []
    for port in replicated_cluster.primary_ports():
        with redis.Redis(port=port) as client:
            try:
                marks.append(client.exists(names.replication_mark_of(task_id)))
            except redis.exceptions.MovedError:
                marks.append(-1)  # the slot is another primary's
    assert sorted(marks) == [-1, -1, 1], "the mark was written, on the primary that holds the task"


async def test_a_reply_goes_out_before_wait_answers_as_on_one_redis(tmp_path: Path, names: Names) -> None:
    """A replica slow to acknowledge delays the write's ``WAIT``, and so the commit behind it, not the
    caller's answer: the reply frames go out once the scripts stored the ends, as one Redis's script
    publishes them before its ``WAIT``. The replicas stay stopped until every reply is heard, so a
    write that sent them after ``WAIT`` answers would have none acknowledged."""
    wait_ms = 20_000
    with LocalRedisCluster(tmp_path / "cluster", replicas=1) as cluster:
        pool = replace(STORE_POOL, socket_timeout_s=STORE_POOL.socket_timeout_s + wait_ms / 1000)  # as roles.py
        store = RedisTaskStore(cluster.url, names, pool=pool)
        await store.start()
        try:
            _, replies = await _following(store, "g1")
            primaries = cluster.primary_ports()
            stopped = [node.pid for node in cluster.nodes if node.port not in primaries and node.pid is not None]
            assert len(stopped) == 3, "a replica per primary"
            ends = [state(f"slow-{n}", TaskStatus.COMPLETED, output=f"o{n}", reply_to="g1") for n in range(6)]
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
            write = asyncio.create_task(store.apply_replicated(ends, 1, wait_ms))
            try:
                heard = [await asyncio.wait_for(replies.get(), 10) for _ in ends]
            except TimeoutError:
                write.cancel()
                raise
            finally:
                for pid in stopped:
                    os.kill(pid, signal.SIGCONT)
            assert sorted((reply.task_id, reply.output) for reply in heard) == [(e.task_id, e.output) for e in ends]
            assert await asyncio.wait_for(write, 60) == 1, "WAIT still waited: the resumed replicas acknowledged"
        finally:
            await store.close()


async def test_after_a_primarys_failover_replies_and_watches_follow_its_slots(tmp_path: Path, names: Names) -> None:
    """kill -9 of the primary that holds a gateway's reply channel and a watched task: once its replica
    took over, the feed is connected again, says it came back (the gateway re-reads its callers), and
    the next end of a task reaches both its reply listener and its watcher."""
    async with _own_cluster(tmp_path, names, replicas=1) as (cluster, store):
        returned, replies = await _following(store, "g1")
        channel = names.reply_channel("g1")
        victim = next(node for node in cluster.nodes if _serves(node.port, key_slot(channel.encode())))
        task_id = next(f"w{n}" for n in range(1_000) if _serves(victim.port, key_slot(f"w{n}".encode())))
        queued = state(task_id, TaskStatus.QUEUED, reply_to="g1")
        await store.create(queued)
        # Replication is asynchronous: a task the killed primary had not yet sent its replica is
        # gone after the failover, and the end of a task no one stored is not published on its
        # channel. Wait for the replica, as a caller that needs the task to outlive its primary does.
        assert await store.apply_replicated([queued], 1, WAIT_MS) == 1, "the replica holds the task"
        async with store.watch(task_id) as events:
            victim.kill()
            await asyncio.wait_for(returned.wait(), 30)
            assert store.reachable(), "every hub it needs is connected, the dead node's closed"
            done = state(task_id, TaskStatus.COMPLETED, output="after", reply_to="g1")
            assert await _applied_once_served(store, done)
            await _heard(replies, events, task_id, "after")


async def test_a_primarys_pubsub_connection_dropped_comes_back_with_channels_of_several_slots(
    tmp_path: Path, names: Names
) -> None:
    """A primary drops the feed's connection (a restart, a network blip, an unanswered PING): the hub
    subscribes its channels again, one SSUBSCRIBE per slot (Redis refuses one that spans slots), and a
    task's end reaches its reply listener and its watcher."""
    async with _own_cluster(tmp_path, names) as (cluster, store):
        returned, replies = await _following(store, "g1")
        channel = names.reply_channel("g1")
        node = next(node for node in cluster.nodes if _serves(node.port, key_slot(channel.encode())))
        task_id = next(
            f"p{n}"
            for n in range(1_000)
            if _serves(node.port, key_slot(f"p{n}".encode()))
            and key_slot(f"p{n}".encode()) != key_slot(channel.encode())
        )
        await store.create(state(task_id, TaskStatus.QUEUED, reply_to="g1"))
        async with store.watch(task_id) as events:
            with redis.Redis(port=node.port) as raw:
                assert raw.client_kill_filter(_type="pubsub") >= 1, "the feed's connection to the node"
            await asyncio.wait_for(returned.wait(), 30)
            assert store.reachable(), "the hub is connected again"
            done = state(task_id, TaskStatus.COMPLETED, output="again", reply_to="g1")
            assert await store.apply([done]) == [True]
            await _heard(replies, events, task_id, "again")


async def test_a_second_watcher_of_a_channel_joins_the_hub_that_holds_it_whatever_the_slot_map_says(
    redis_cluster: str, names: Names
) -> None:
    """The slot map can name a new owner before the channel moved (a refresh after a migration or a
    failover): a second watcher subscribing there, and the first unsubscribing from there as it left,
    would leave the second one deaf."""
    store = RedisTaskStore(redis_cluster, names)
    await store.start()
    try:
        task_id = "moved-1"
        await store.create(state(task_id, TaskStatus.QUEUED))
        hubs = store._feed._hub
        assert isinstance(hubs, ShardedHubs)
        nodes = hubs._cluster.nodes_manager
        slot = key_slot(task_id.encode())
        owner = nodes.slots_cache[slot][0]
        other = next(node for node in nodes.get_nodes_by_server_type("primary") if node.name != owner.name)
        first = store.watch(task_id)
        await first.__aenter__()
        nodes.slots_cache[slot] = [other]  # a map that names another owner than the hub's
        try:
            async with store.watch(task_id) as second:
                nodes.slots_cache[slot] = [owner]
                await first.__aexit__(None, None, None)  # the first watcher leaves
                assert await store.apply([state(task_id, TaskStatus.COMPLETED, output="heard")]) == [True]
                seen = await asyncio.wait_for(anext(second), 10)
                assert (seen.status, seen.output) == (TaskStatus.COMPLETED, "heard")
        finally:
            nodes.slots_cache[slot] = [owner]
    finally:
        await store.close()


async def test_a_watch_after_the_store_closed_fails_and_starts_no_reader(redis_cluster: str, names: Names) -> None:
    """A closed store's feed refuses a new watch, as over one Redis, rather than start a hub (a reader task
    and a connection) that nothing will close."""
    store = RedisTaskStore(redis_cluster, names)
    await store.start()
    await store.close()
    hubs = store._feed._hub
    assert isinstance(hubs, ShardedHubs)
    try:
        with pytest.raises(TransportError):
            async with store.watch("late-1"):
                pass
    finally:
        left = list(hubs._hubs.values())
        for hub in left:
            await hub.close()
    assert left == [], f"a closed feed started {len(left)} hub(s)"


async def test_a_watch_follows_its_slot_to_another_primary(tmp_path: Path, names: Names) -> None:
    """The slot moves to another primary (``CLUSTER SETSLOT``, as a resharding does); its old owner ends
    the shard channels of the slot (``sunsubscribe``): the feed moves the watch to the new owner, and
    the task's end reaches the watcher."""
    async with _own_cluster(tmp_path, names) as (cluster, store):
        task_id = "slot-1"  # not stored: its slot holds no key, so the slot can be handed over as it is
        slot = key_slot(task_id.encode())
        owner = next(node for node in cluster.nodes if _serves(node.port, slot))
        heir = next(node for node in cluster.nodes if node.port != owner.port)
        async with store.watch(task_id) as events:
            with redis.Redis(port=heir.port) as client:
                heir_id = client.execute_command("CLUSTER", "MYID")
            for node in (owner, heir):
                with redis.Redis(port=node.port) as client:
                    client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", heir_id)
            assert await _applied_once_served(store, state(task_id, TaskStatus.COMPLETED, output="moved"))
            await _ends_with(events, "moved")
            assert store.reachable(), "the hub of the old owner is connected again"


async def test_a_slot_moved_off_a_node_moves_its_channels_and_the_feed_stays_connected(
    tmp_path: Path, names: Names
) -> None:
    """A resharding moves one slot of the node that holds two watched channels: Redis ends the moved
    slot's subscription (``sunsubscribe``) and no other. The feed moves that channel alone; its
    connection to the node is no lost connection, so the store never reads unreachable (which a
    gateway answers 503) and nothing reconnects; both watches hear their task's end."""
    async with _own_cluster(tmp_path, names) as (cluster, store):
        moved_id = "slot-1"  # not stored before the move: its slot holds no key to migrate
        slot = key_slot(moved_id.encode())
        owner = next(node for node in cluster.nodes if _serves(node.port, slot))
        heir = next(node for node in cluster.nodes if node.port != owner.port)
        kept_id = next(
            f"k{n}"
            for n in range(1_000)
            if _serves(owner.port, key_slot(f"k{n}".encode())) and key_slot(f"k{n}".encode()) != slot
        )
        await store.create(state(kept_id, TaskStatus.QUEUED))
        async with store.watch(kept_id) as kept, store.watch(moved_id) as events, _reachable_throughout(store) as gaps:
            await asyncio.to_thread(_move_slot, cluster, slot, owner.port, heir.port)
            assert await _applied_once_served(store, state(moved_id, TaskStatus.COMPLETED, output="moved"))
            await _ends_with(events, "moved")
            assert await store.apply([state(kept_id, TaskStatus.COMPLETED, output="kept")]) == [True]
            await _ends_with(kept, "kept")
        assert gaps == [], f"the store read unreachable while one slot moved: {gaps}"
        assert store.reconnects == 0, "no PubSub connection was lost"


async def test_a_watcher_that_joins_while_its_channel_moves_moves_with_it(tmp_path: Path, names: Names) -> None:
    """A second watcher subscribes on the slot's old owner's hub while the channel's references are
    being subscribed on the new owner's: its reference moves too, so the first watcher leaving does
    not unsubscribe the channel from under it."""
    joined: list[Any] = []
    async with _channel_to_move(tmp_path, names) as (store, move, hubs, target):
        task_id, channel = move.task_id, names.task_channel(move.task_id)
        subscribe = target.subscribe

        async def subscribe_as_another_joins(name: str) -> None:
            if name == channel and not joined:
                second = store.watch(task_id)
                joined.append((second, await second.__aenter__()))
            await subscribe(name)

        target.subscribe = subscribe_as_another_joins  # type: ignore[method-assign,assignment]
        first = store.watch(task_id)
        await first.__aenter__()
        await asyncio.to_thread(move.run)
        await eventually(
            lambda: joined and hubs._of.get(channel) is target, "the channel to move, a watcher joining meanwhile"
        )
        await first.__aexit__(None, None, None)  # the first watcher leaves
        second, events = joined[0]
        try:
            assert await _applied_once_served(store, state(task_id, TaskStatus.COMPLETED, output="heard"))
            try:
                await _ends_with(events, "heard")
            except TimeoutError:
                pytest.fail("the watcher that joined during the move was unsubscribed when the first left")
        finally:
            await second.__aexit__(None, None, None)


async def test_a_move_that_fails_halfway_leaves_no_reference_on_the_new_owner(tmp_path: Path, names: Names) -> None:
    """Moving a channel's references fails after some were subscribed on the new owner's hub: the move is
    tried again, and once every watcher left, the new owner's hub holds the channel no more."""
    calls: list[str] = []
    async with _channel_to_move(tmp_path, names) as (store, move, hubs, target):
        task_id, channel = move.task_id, names.task_channel(move.task_id)
        subscribe = target.subscribe

        async def second_subscribe_fails(name: str) -> None:
            if name == channel:
                calls.append(name)
                if len(calls) == 2:
                    raise TransportError("refused once, as a node mid-failover may")
            await subscribe(name)

        target.subscribe = second_subscribe_fails  # type: ignore[method-assign,assignment]
        async with store.watch(task_id), store.watch(task_id) as events:
            await asyncio.to_thread(move.run)
            await eventually(lambda: hubs._of.get(channel) is target, "the channel to move, at the second try")
            assert await _applied_once_served(store, state(task_id, TaskStatus.COMPLETED, output="moved"))
            await _ends_with(events, "moved")
        assert len(calls) >= 3, f"the move failed once and was tried again: {len(calls)} subscribe(s)"
        assert target.refs(channel) == 0, f"every watcher left, yet the new owner holds {target.refs(channel)}"


async def test_a_watch_subscribed_on_a_slots_old_owner_follows_it_to_the_new_one(tmp_path: Path, names: Names) -> None:
    """The slot map names a slot's old owner (it moved since the map was read): the SSUBSCRIBE there
    answers ``MOVED``, and the feed subscribes the channel on the new owner, its connection to the old
    one kept, so the store never reads unreachable, and the watch hears its task's end."""
    async with _own_cluster(tmp_path, names) as (cluster, store):
        task_id = "stale-1"
        slot = key_slot(task_id.encode())
        owner = next(node for node in cluster.nodes if _serves(node.port, slot))
        heir = next(node for node in cluster.nodes if node.port != owner.port)
        kept_id = next(
            f"k{n}"
            for n in range(1_000)
            if _serves(owner.port, key_slot(f"k{n}".encode())) and key_slot(f"k{n}".encode()) != slot
        )
        hubs = store._feed._hub
        assert isinstance(hubs, ShardedHubs)
        nodes = hubs._cluster.nodes_manager
        stale = nodes.slots_cache[slot]
        async with store.watch(kept_id), _reachable_throughout(store) as gaps:
            await asyncio.to_thread(_move_slot, cluster, slot, owner.port, heir.port)
            nodes.slots_cache[slot] = stale  # as read before the move
            async with asyncio.timeout(10), store.watch(task_id) as events:
                assert await _applied_once_served(store, state(task_id, TaskStatus.COMPLETED, output="followed"))
                await _ends_with(events, "followed")
        assert gaps == [], f"the store read unreachable while a watch followed its slot: {gaps}"
        assert store.reconnects == 0, "no PubSub connection was lost"


async def test_a_watch_on_a_dead_primarys_slot_fails_as_a_transport_error_until_its_replica_serves(
    tmp_path: Path, names: Names
) -> None:
    """Mid-failover the slot map still names the killed primary: a first watch of one of its slots
    fails with ``TransportError`` (which the gateway answers 503), not redis-py's own error (a 500),
    and one made once the replica took over works."""
    async with _own_cluster(tmp_path, names, replicas=1) as (cluster, store):
        victim = next(node for node in cluster.nodes if _serves(node.port, 0))
        task_id = next(
            f"d{n}" for n in range(1_000) if _serves(victim.port, key_slot(names.task_channel(f"d{n}").encode()))
        )
        victim.kill()
        with pytest.raises(TransportError, match="subscribing to"):
            async with store.watch(task_id):
                pass
        for _ in range(300):
            try:
                async with store.watch(task_id):
                    break
            except TransportError:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("no watch of the dead primary's slot worked within 30 s of the kill")


async def test_a_frozen_primarys_commands_fail_after_the_socket_timeout_then_reach_its_replica(
    tmp_path: Path, names: Names
) -> None:
    """A primary that stops answering (SIGSTOP) fails a read after the socket timeout, as one Redis does,
    rather than holding it through the cluster client's retries; the timeout has the slot map read
    again, so once the replica took over, a write of one of the frozen primary's tasks reaches it."""
    pool = replace(STORE_POOL, socket_timeout_s=0.5)
    with LocalRedisCluster(tmp_path / "cluster", replicas=1) as cluster:
        store = RedisTaskStore(cluster.url, names, pool=pool)
        await store.start()
        victim = next(node for node in cluster.nodes if _serves(node.port, 0))
        with redis.RedisCluster(host="127.0.0.1", port=victim.port) as client:
            owner = client.nodes_manager.get_node_from_slot
            task_ids = (f"f{n}" for n in itertools.count())
            frozen = (i for i in task_ids if int(owner(key_slot(names.task_key(i).encode())).port) == victim.port)
            first, *later = itertools.islice(frozen, 1 + FROZEN_TRIES)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(TransportError, match="TimeoutError"):
                await store.get(first)
            took_s = time.monotonic() - started
            created = False
            for task_id in later:  # each try fails after the socket timeout until the replica took over
                try:
                    created = await store.create(state(task_id, TaskStatus.QUEUED))
                    break
                except TransportError:
                    await asyncio.sleep(0.1)
        finally:
            os.kill(victim.pid, signal.SIGCONT)
            await store.close()
    assert took_s < 2.0, f"a read from a frozen primary took {took_s:.2f} s; the socket timeout is 0.5 s"
    assert created, "no task of the frozen primary's slots was created once its replica could take over"


@asynccontextmanager
async def _own_cluster(
    tmp_path: Path, names: Names, *, replicas: int = 0
) -> AsyncIterator[tuple[LocalRedisCluster, RedisTaskStore]]:
    """A cluster of this test's own (one it stops or reshapes), and a store started over it."""
    with LocalRedisCluster(tmp_path / "cluster", replicas=replicas) as cluster:
        store = RedisTaskStore(cluster.url, names)
        await store.start()
        try:
            yield cluster, store
        finally:
            await store.close()


async def _following(store: RedisTaskStore, gateway_id: str) -> tuple[asyncio.Event, asyncio.Queue[TaskState]]:
    """What a gateway follows: its feed's return (set each time), and the replies to it."""
    returned = asyncio.Event()
    store.on_feed_return(returned.set)
    replies: asyncio.Queue[TaskState] = asyncio.Queue()
    await store.listen_replies(gateway_id, replies.put_nowait)
    return returned, replies


async def _heard(
    replies: asyncio.Queue[TaskState], events: AsyncIterator[TaskState], task_id: str, output: str
) -> None:
    """The task's end with ``output`` reached both its gateway's reply listener and its watcher."""
    reply = await asyncio.wait_for(replies.get(), 10)
    assert (reply.task_id, reply.output) == (task_id, output)
    await _ends_with(events, output)


async def _ends_with(events: AsyncIterator[TaskState], output: str) -> None:
    """The watcher hears its task complete with ``output``; the state re-read when the feed came back
    (or its channel moved) may come first."""
    seen = await asyncio.wait_for(anext(events), 10)
    while seen.status is not TaskStatus.COMPLETED:
        seen = await asyncio.wait_for(anext(events), 10)
    assert seen.output == output


@dataclass(frozen=True)
class _Move:
    task_id: str
    run: Callable[[], None]
    """Moves the task's slot to the other node (blocking: run it in a thread)."""


@asynccontextmanager
async def _channel_to_move(
    tmp_path: Path, names: Names
) -> AsyncIterator[tuple[RedisTaskStore, _Move, ShardedHubs, Any]]:
    """A cluster of this test's own, a task whose slot is about to move, and the hub of the node it moves
    to, started before the move (a watch of another task on that node holds it)."""
    async with _own_cluster(tmp_path, names) as (cluster, store):
        task_id = "slot-1"  # not stored before the move: its slot holds no key to migrate
        slot, owner, heir, heir_id = _slot_and_heir(cluster, task_id)
        hubs = store._feed._hub
        assert isinstance(hubs, ShardedHubs)
        async with store.watch(heir_id):
            target = next(hub for hub in hubs._hubs.values() if heir_id in str(hub.channels()))
            yield store, _Move(task_id, lambda: _move_slot(cluster, slot, owner, heir)), hubs, target


def _slot_and_heir(cluster: LocalRedisCluster, task_id: str) -> tuple[int, int, int, str]:
    """``task_id``'s slot, the port of the node that serves it, the port of another node (its heir in a
    move), and a task id whose slot that other node serves (a watch of it starts the heir's hub)."""
    slot = key_slot(task_id.encode())
    owner = next(node.port for node in cluster.nodes if _serves(node.port, slot))
    heir = next(node.port for node in cluster.nodes if node.port != owner)
    heir_id = next(f"h{n}" for n in range(1_000) if _serves(heir, key_slot(f"h{n}".encode())))
    return slot, owner, heir, heir_id


def _move_slot(cluster: LocalRedisCluster, slot: int, owner: int, heir: int) -> None:
    """Moves an empty ``slot`` from the primary on ``owner`` to the one on ``heir`` as a resharding
    does (``redis-cli --cluster reshard``): importing, migrating, then the new owner told to every node."""
    with redis.Redis(port=heir, decode_responses=True) as client:
        heir_id = client.execute_command("CLUSTER", "MYID")
    with redis.Redis(port=owner, decode_responses=True) as client:
        owner_id = client.execute_command("CLUSTER", "MYID")
    with redis.Redis(port=heir) as client:
        client.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", owner_id)
    with redis.Redis(port=owner) as client:
        client.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", heir_id)
    for port in sorted(cluster.primary_ports(), key=lambda port: (port != heir, port != owner)):
        with redis.Redis(port=port) as client:
            client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", heir_id)


@asynccontextmanager
async def _reachable_throughout(store: RedisTaskStore) -> AsyncIterator[list[float]]:
    """Samples ``store.reachable()`` every millisecond meanwhile; yields the list of the times (from
    the start) it read False, filled as it goes."""
    gaps: list[float] = []
    start = time.monotonic()

    async def sample() -> None:
        while True:
            if not store.reachable():
                gaps.append(round(time.monotonic() - start, 3))
            await asyncio.sleep(0.001)

    sampler = asyncio.create_task(sample())
    try:
        yield gaps
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler


def _serves(port: int, slot: int) -> bool:
    """Whether the node on ``port`` is the primary serving ``slot``."""
    with redis.RedisCluster(host="127.0.0.1", port=port) as client:
        return int(client.nodes_manager.get_node_from_slot(slot).port) == port


async def _applied_once_served(store: RedisTaskStore, done: TaskState) -> bool:
    """Applies ``done``, retrying while the cluster client still routes to the dead primary."""
    for _ in range(100):
        try:
            return (await store.apply([done])) == [True]
        except TransportError:
            await asyncio.sleep(0.1)
    return False


@pytest.mark.parametrize("replicated", [False, True], ids=["apply", "apply_replicated"])
async def test_a_write_one_of_whose_slots_fails_still_answers_the_tasks_the_others_stored(
    redis_cluster: str, names: Names, replicated: bool
) -> None:
    """A write runs one script call per hash slot: one that fails (here a key of another type) fails the
    write, and the tasks the other calls stored still reach their gateway at once, not only when its
    sweep reads a reply it takes for lost."""
    good = "good-0"
    bad = next(f"bad-{n}" for n in range(100) if key_slot(f"bad-{n}".encode()) != key_slot(good.encode()))
    raw = cluster_client(redis_cluster, PoolOptions())
    store = RedisTaskStore(redis_cluster, names)
    await store.start()
    try:
        await raw.set(names.task_key(bad), "not a task")
        _, replies = await _following(store, "g1")
        ends = [state(task_id, TaskStatus.COMPLETED, output="x", reply_to="g1") for task_id in (good, bad)]
        with pytest.raises(TransportError):
            await (store.apply_replicated(ends, 1, 100) if replicated else store.apply(ends))
        assert (await asyncio.wait_for(replies.get(), 5)).task_id == good
        assert replies.empty(), "the failed slot's task was not answered"
    finally:
        await store.close()
        await raw.aclose()


async def test_a_key_moving_to_a_node_added_since_the_slot_map_was_read_is_followed_there(tmp_path: Path) -> None:
    """A scale-out: a node joins, and a key's slot migrates to it while a client still holds the slot map
    it read before the node joined. The old owner answers ``ASK`` for the moved key, naming the new
    node, and the command is followed there (redis-py follows a ``MOVED`` to a node it has not met, but
    looked an ``ASK``'s node up in its cache alone, and failed with an AttributeError of its own: a
    batcher's credit claim died of it during a rebalance)."""
    with LocalRedisCluster(tmp_path / "cluster") as cluster:
        joining = RedisServer(tmp_path / "joining", cluster=True)
        joining.start()
        try:
            client = cluster_client(cluster.url, PoolOptions())
            try:
                key = f"credits-{uuid.uuid4().hex}"
                await client.zadd(key, {"w1:1": 1.0})  # the slot map is read now, without the joining node
                slot = key_slot(key.encode())
                owner = int(client.nodes_manager.get_node_from_slot(slot).port)
                with redis.Redis(port=owner, decode_responses=True) as first:
                    bus = joining.port - CLUSTER_BUS_OFFSET
                    first.execute_command("CLUSTER", "MEET", "127.0.0.1", joining.port, bus)
                    owner_id = first.execute_command("CLUSTER", "MYID")
                with redis.Redis(port=joining.port, decode_responses=True) as new:
                    new_id = new.execute_command("CLUSTER", "MYID")
                    deadline = time.monotonic() + 30
                    while "cluster_state:ok" not in new.execute_command("CLUSTER", "INFO"):
                        assert time.monotonic() < deadline, "the joining node learns who serves every slot"
                        await asyncio.sleep(0.05)
                    new.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", owner_id)
                with redis.Redis(port=owner) as old:
                    deadline = time.monotonic() + 30
                    while new_id not in old.execute_command("CLUSTER", "NODES").decode():
                        assert time.monotonic() < deadline, "the owner knows the joining node"
                        await asyncio.sleep(0.05)
                    old.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", new_id)
                    old.migrate("127.0.0.1", joining.port, [key], 0, 5000)
                popped = await client.bzpopmin([key], timeout=1)
                assert popped is not None and popped[1] == b"w1:1", popped
            finally:
                await client.aclose()
        finally:
            joining.stop()
