"""What only the Redis task store can show: key layout, the TTL at a task's first write and at its end,
one reply message per write, surviving a PubSub drop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Collection, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from infra.redis_server import RedisServer
from schemas.codec import decode_state, encode_state
from schemas.records import TaskState, TaskStatus
from schemas.wire import Names
from tests.support.eventually import eventually
from tests.support.task_states import EVENT_TIMEOUT_S, next_state, state
from transport.cancelling import cancel_and_wait
from transport.ports import TransportError
from transport.redis.pools import PoolOptions
from transport.redis.pubsub import PubSubHub
from transport.redis.store import RedisTaskStore

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]

TTL_S = 3600


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def store(redis_url: str, names: Names) -> AsyncIterator[RedisTaskStore]:
    store = RedisTaskStore(redis_url, names, ttl_s=TTL_S)
    await store.start()
    yield store
    await store.close()


async def test_task_is_a_hash_with_status_and_avro_doc(store: RedisTaskStore, raw: Redis, names: Names) -> None:
    queued = state("t1", TaskStatus.QUEUED)
    await store.create(queued)

    fields = await raw.hgetall(names.task_key("t1"))
    assert fields[b"status"] == b"queued"
    doc = fields[b"doc"]
    assert isinstance(doc, bytes)
    assert decode_state(doc) == queued


async def test_the_ttl_is_set_where_a_task_is_first_stored_and_where_it_ends(
    store: RedisTaskStore, raw: Redis, names: Names
) -> None:
    key = names.task_key("t1")
    await store.create(state("t1", TaskStatus.QUEUED))
    assert (TTL_S - 5) * 1000 < await raw.pttl(key) <= TTL_S * 1000

    await raw.pexpire(key, 5000)
    await store.apply([state("t1", TaskStatus.RUNNING)])
    assert await raw.pttl(key) <= 5000, "a step between the first write and the end leaves the TTL"
    await store.apply([state("t1", TaskStatus.COMPLETED, output="ok")])
    assert await raw.pttl(key) > (TTL_S - 5) * 1000, "the end sets it: a result is kept ttl_s"

    await store.apply([state("first", TaskStatus.RUNNING)])
    assert await raw.pttl(names.task_key("first")) > (TTL_S - 5) * 1000, "a hash an update creates expires"
    await store.apply([state("late", TaskStatus.COMPLETED)])
    assert await raw.pttl(names.task_key("late")) > (TTL_S - 5) * 1000


async def test_one_write_ending_many_tasks_sends_each_gateway_one_reply_message(
    store: RedisTaskStore, raw: Redis, names: Names
) -> None:
    got: dict[str, list[TaskState]] = {"g1": [], "g2": []}
    for gateway in got:
        await store.listen_replies(gateway, got[gateway].append)
    listener = raw.pubsub()
    await listener.subscribe(names.reply_channel("g1"))
    await listener.get_message(timeout=1.0)  # the subscription's confirmation
    ended = [state(f"t{i}", TaskStatus.COMPLETED, output=f"o{i}", reply_to=f"g{1 + i % 2}") for i in range(5)]
    assert await store.apply([*ended, state("t9", TaskStatus.RUNNING, reply_to="g1")]) == [True] * 6
    await eventually(lambda: len(got["g1"]) == 3 and len(got["g2"]) == 2, "every ended task's reply")
    assert [s.task_id for s in got["g1"]] == ["t0", "t2", "t4"] and [s.output for s in got["g2"]] == ["o1", "o3"]
    messages = []
    while (message := await listener.get_message(timeout=0.5)) is not None:
        messages.append(message)
    assert len(messages) == 1, f"one message for g1's three tasks, got {len(messages)}"
    await listener.aclose()


async def test_an_undecodable_frame_leaves_the_other_replies_of_its_message_delivered(
    store: RedisTaskStore, raw: Redis, names: Names, caplog: pytest.LogCaptureFixture
) -> None:
    """One frame another version wrote, or a damaged one: the message's other ends reach their callers
    now, not at the lost-reply sweep; the bad one is counted and logged."""
    got: list[TaskState] = []
    await store.listen_replies("g1", got.append)
    good = [state(f"t{i}", TaskStatus.COMPLETED, output=f"o{i}", reply_to="g1") for i in range(2)]
    frames = [encode_state(good[0]), b"\x00\xffnot a state", encode_state(good[1])]
    message = b"".join(len(doc).to_bytes(4, "big") + doc for doc in frames)
    with caplog.at_level(logging.WARNING, logger="transport.redis.feed"):
        assert await raw.publish(names.reply_channel("g1"), message) == 1
        await eventually(lambda: len(got) == 2, "the message's two good replies")
    assert [s.output for s in got] == ["o0", "o1"]
    assert [r.getMessage() for r in caplog.records if "undecodable" in r.getMessage()], caplog.text


async def test_a_large_apply_is_one_call(store: RedisTaskStore) -> None:
    updates = [state(f"t{i}", TaskStatus.RUNNING) for i in range(2000)]
    assert await store.apply(updates) == [True] * 2000
    assert await store.apply(updates) == [False] * 2000
    assert len(await store.get_many([u.task_id for u in updates])) == 2000


async def test_one_unreadable_stored_task_leaves_the_others_of_a_get_many_readable(
    store: RedisTaskStore, raw: Redis, names: Names, caplog: pytest.LogCaptureFixture
) -> None:
    """A record another version wrote (a rolling upgrade) or a damaged one: the sweeps that read many
    tasks at once still answer every other caller, and the one read alone says what is wrong."""
    assert await store.apply([state("t1", TaskStatus.COMPLETED), state("t2", TaskStatus.COMPLETED)]) == [True] * 2
    await raw.hset(names.task_key("t2"), "doc", b"not avro")

    found = await store.get_many(["t1", "t2"])

    assert list(found) == ["t1"] and found["t1"].status is TaskStatus.COMPLETED
    assert "stored state of task t2 cannot be read" in caplog.text
    with pytest.raises(TransportError, match="stored state of task t2 cannot be read"):
        await store.get("t2")


@pytest.fixture
def own_redis_url(tmp_path: Path) -> Iterator[str]:
    """A redis-server of this test's own: it kills every PubSub connection, which on the shared server
    would cut other tests' listeners."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


async def test_pubsub_drop_reconnects_and_resubscribes(own_redis_url: str, names: Names) -> None:
    store = RedisTaskStore(own_redis_url, names, ttl_s=TTL_S)
    await store.start()
    raw = Redis.from_url(own_redis_url)
    try:
        await _drop_pubsub_and_follow(store, raw)
    finally:
        await raw.aclose()
        await store.close()


async def _drop_pubsub_and_follow(store: RedisTaskStore, raw: Redis) -> None:
    await store.create(state("t1", TaskStatus.QUEUED, reply_to="g1"))
    replies: list[TaskState] = []
    replied = asyncio.Event()

    def on_reply(reply: TaskState) -> None:
        replies.append(reply)
        replied.set()

    await store.listen_replies("g1", on_reply)
    feed_returns: list[bool] = []
    store.on_feed_return(lambda: feed_returns.append(store.reachable()))
    assert store.reachable()
    async with store.watch("t1") as events:
        killed = await raw.client_kill_filter(_type="pubsub")
        assert killed >= 1, "expected to kill the store's PubSub connection"
        # Unreachable from the drop until the reconnect, which waits its first backoff (50 ms) first.
        await eventually(lambda: not store.reachable(), "the store to notice its dropped connection", timeout_s=20)
        # No await between the check above and ready()'s own check of the connection: not a race.
        assert await store.ready() is False, "not ready while the change feed reconnects"
        await eventually(lambda: store.reconnects >= 1, "the PubSub reader to reconnect", timeout_s=20)
        assert store.reachable(), "reachable again once reconnected"
        await eventually(lambda: bool(feed_returns), "the store to call back on its feed's return", timeout_s=20)
        assert feed_returns == [True], f"one call back, once the feed is subscribed again, got {feed_returns}"

        await store.apply([state("t1", TaskStatus.COMPLETED, output="ok", reply_to="g1")])
        seen = await next_state(events)
        while seen.status is not TaskStatus.COMPLETED:  # a re-read of the stored state may come first
            seen = await next_state(events)
        assert seen.output == "ok"
        await asyncio.wait_for(replied.wait(), EVENT_TIMEOUT_S)
        assert [r.task_id for r in replies] == ["t1"]


async def test_an_end_published_while_the_feed_is_down_reaches_its_watcher(own_redis_url: str, names: Names) -> None:
    """PubSub keeps nothing for a subscriber that is away: the end comes from the feed's re-read of the
    watched task once it subscribed again, not from a long-poll's or a stream's next recheck."""
    store = RedisTaskStore(own_redis_url, names, ttl_s=TTL_S)
    await store.start()
    raw = Redis.from_url(own_redis_url)
    try:
        await store.create(state("t1", TaskStatus.QUEUED))
        async with store.watch("t1") as events:
            hub = store._feed._hub
            assert isinstance(hub, PubSubHub)
            async with hub._lock:  # the reconnect waits for it: the end is published to no subscriber
                assert await raw.client_kill_filter(_type="pubsub") >= 1
                await store.apply([state("t1", TaskStatus.COMPLETED, output="ok")])
            seen = await next_state(events)
            assert (seen.status, seen.output) == (TaskStatus.COMPLETED, "ok")
            assert store.reconnects >= 1
    finally:
        await raw.aclose()
        await store.close()


async def test_a_connection_closed_while_the_reader_does_not_read_is_a_lost_one(
    own_redis_url: str, names: Names
) -> None:
    """Its pool closes the PubSub connection while the reader does not read (a Sentinel primary follower
    does, here as the reader re-reads after a reconnect): redis-py reopens such a connection and
    subscribes again by itself, so what was published meanwhile would never be re-read. The hub takes
    it as a lost connection, reconnects, and the watcher hears the end published while it was closed."""
    store = RedisTaskStore(own_redis_url, names, ttl_s=TTL_S)
    await store.start()
    raw = Redis.from_url(own_redis_url)
    feed = store._feed
    hub = feed._hub
    assert isinstance(hub, PubSubHub)
    read = feed._read
    closed: list[bool] = []

    async def read_then_close(task_ids: Collection[str]) -> dict[str, TaskState]:
        states = await read(task_ids)
        if not closed:
            closed.append(True)
            assert hub._pubsub is not None and hub._pubsub.connection is not None
            await hub._pubsub.connection.disconnect()
            await store.apply([state("t1", TaskStatus.COMPLETED, output="unheard")])  # to no subscriber
        return states

    feed._read = read_then_close
    try:
        await store.create(state("t1", TaskStatus.QUEUED))
        async with store.watch("t1") as events:
            assert await raw.client_kill_filter(_type="pubsub") >= 1
            seen = await next_state(events)
            while seen.status is not TaskStatus.COMPLETED:  # the first re-read's "queued" comes first
                seen = await next_state(events)
            assert seen.output == "unheard"
    finally:
        await raw.aclose()
        await store.close()


async def test_a_watcher_cancelled_while_the_feed_is_busy_still_unsubscribes(
    store: RedisTaskStore, raw: Redis, names: Names
) -> None:
    """An SSE client that leaves has its watch cancelled, and cancelled again every 50 ms until it ends
    (``cancel_and_wait``), while the feed may hold its lock (a reconnect subscribing every channel again)."""
    channel = names.task_channel("t1")
    subscribed = asyncio.Event()

    async def follow() -> None:
        async with store.watch("t1") as events:
            subscribed.set()
            await anext(events)

    following = asyncio.create_task(follow())
    await asyncio.wait_for(subscribed.wait(), EVENT_TIMEOUT_S)
    hub = store._feed._hub
    assert isinstance(hub, PubSubHub)
    await hub._lock.acquire()  # as a reconnect holds it
    asyncio.get_running_loop().call_later(0.3, hub._lock.release)
    await cancel_and_wait(following)
    await eventually(lambda: not hub._lock.locked(), "the feed's lock to be free again")
    await eventually(lambda: hub.refs(channel) == 0, "the watcher's reference to the channel to go")

    async def numsub() -> int:
        return int(dict(await raw.pubsub_numsub(channel))[channel.encode()])

    deadline = asyncio.get_running_loop().time() + EVENT_TIMEOUT_S
    while await numsub() != 0:
        assert asyncio.get_running_loop().time() < deadline, "the channel is still subscribed on Redis"
        await asyncio.sleep(0.05)


async def test_a_watcher_cancelled_while_its_subscribe_is_being_sent_leaves_no_subscription(
    store: RedisTaskStore, raw: Redis, names: Names, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long-poll whose client leaves is cancelled wherever it waits; here in the send of its SUBSCRIBE,
    which waits while the connection's write buffer drains (a busy Redis reads it late). The channel's
    reference goes with it, as it does for a watcher cancelled once the send returned."""
    hub = store._feed._hub
    assert isinstance(hub, PubSubHub) and hub._pubsub is not None
    pubsub = hub._pubsub
    written = asyncio.Event()
    send = pubsub.subscribe

    async def draining(*channels: str) -> None:
        await send(*channels)  # the command is written...
        written.set()
        await asyncio.Event().wait()  # ...and the buffer never drains

    monkeypatch.setattr(pubsub, "subscribe", draining)
    channel = names.task_channel("t1")

    async def watch() -> None:
        async with store.watch("t1"):
            pass

    watching = asyncio.create_task(watch())
    await asyncio.wait_for(written.wait(), EVENT_TIMEOUT_S)
    await cancel_and_wait(watching)
    await eventually(lambda: hub.refs(channel) == 0, "the cancelled watcher's reference to the channel to go")

    async def numsub() -> int:
        return int(dict(await raw.pubsub_numsub(channel))[channel.encode()])

    deadline = asyncio.get_running_loop().time() + EVENT_TIMEOUT_S
    while await numsub() != 0:
        assert asyncio.get_running_loop().time() < deadline, "the channel is still subscribed on Redis"
        await asyncio.sleep(0.05)


async def test_close_ends_watchers_with_an_error(redis_url: str, names: Names) -> None:
    store = RedisTaskStore(redis_url, names)
    await store.start()
    async with store.watch("t1") as events:
        waiting: asyncio.Future[TaskState] = asyncio.ensure_future(anext(events))
        await store.close()
        with pytest.raises(TransportError):
            await asyncio.wait_for(waiting, EVENT_TIMEOUT_S)
    assert await store.ready() is False
    assert store.reachable() is False


async def test_unreachable_redis_fails_start_with_the_address(names: Names) -> None:
    store = RedisTaskStore("redis://:secret@127.0.0.1:1/0", names, pool=PoolOptions(socket_timeout_s=0.5))
    with pytest.raises(TransportError, match=r"127\.0\.0\.1:1\b") as failure:
        await store.start()
    assert "secret" not in str(failure.value)
