"""One Redis PubSub connection per process, read by one owned task, shared by every subscriber.

A gateway watches thousands of tasks at once; a connection per watcher would exhaust Redis and
the pool. The hub reference-counts channels, confirms each SUBSCRIBE before the subscriber goes on
(so "subscribe, then read the stored state" misses nothing), and when the connection drops it
reconnects with backoff and subscribes every channel again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import ConnectionPool
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MovedError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from transport.cancelling import cancel_and_wait
from transport.ports import TransportError
from transport.redis.pools import REDIS_ERRORS, credentials_hint
from transport.retry import told

log = logging.getLogger(__name__)

MessageHandler = Callable[[str, bytes], None]
ResubscribedHandler = Callable[[frozenset[str]], Awaitable[None]]
FailureHandler = Callable[[BaseException], None]

_CONNECTION_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
# uvloop raises RuntimeError ("the handler is closed") for a write on a transport that is closed
# while redis-py still holds it: a SUBSCRIBE sent as the reader tears down a dropped connection.
_SEND_ERRORS = (*_CONNECTION_ERRORS, RuntimeError)


class PubSubHub:
    """Reference-counted channel subscriptions over one PubSub connection and one reader task.

    ``on_message(channel, data)`` runs in the reader task for every published message;
    ``on_resubscribed(channels)`` after a reconnect, since messages published while the connection
    was down are lost (PubSub does not buffer); ``on_failure(err)`` if the reader dies for a reason
    that reconnecting cannot fix, so that waiters fail instead of hanging.
    """

    def __init__(
        self,
        pool: ConnectionPool,
        on_message: MessageHandler,
        on_resubscribed: ResubscribedHandler,
        on_failure: FailureHandler,
        *,
        ping_interval_s: float = 5.0,
        subscribe_timeout_s: float = 5.0,
        min_backoff_s: float = 0.05,
        max_backoff_s: float = 0.5,
        sharded: bool = False,
        on_lost: Callable[[], None] | None = None,
        on_moved: Callable[[frozenset[str]], None] | None = None,
    ) -> None:
        """``sharded``: shard channels (SSUBSCRIBE), each on the cluster node that owns its slot.
        ``on_lost``: runs in the reader task each time the connection is lost, before it reconnects.
        ``on_moved``: sharded, runs in the reader task with the channels whose slot this node no longer
        serves (a resharding: Redis ended their subscription, or refused one with ``MOVED``); they keep
        their references here until the caller subscribed them elsewhere (``forget``), and the connection
        stays. Without it, that counts as a lost connection."""
        self._pool = pool
        self._sharded = sharded
        self._on_lost = on_lost
        self._on_moved = on_moved
        self._on_message = on_message
        self._on_resubscribed = on_resubscribed
        self._on_failure = on_failure
        self.ping_interval_s = ping_interval_s
        self.subscribe_timeout_s = subscribe_timeout_s
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.reconnects = 0
        self.failed_reconnects = 0
        """Reconnects tried and failed, over the hub's life."""
        self._pubsub: PubSub | None = None
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # orders SUBSCRIBE/UNSUBSCRIBE sends against reconnects
        self._refs: dict[str, int] = {}
        self._active: dict[str, asyncio.Future[None]] = {}  # resolved once Redis confirmed the channel
        self._pending: dict[str, deque[asyncio.Future[None]]] = {}  # per SUBSCRIBE sent, in order
        self._failure: BaseException | None = None
        self._connected = False
        self._unsubscribing: dict[str, int] = {}
        """UNSUBSCRIBEs sent and not yet confirmed, per channel: any other (sharded) one came from the
        server, as a slot left this node."""

    @property
    def alive(self) -> bool:
        return self._reader is not None and not self._reader.done()

    @property
    def connected(self) -> bool:
        """Alive and not reconnecting: its connection to Redis has not failed since it was (re)made."""
        return self.alive and self._connected

    async def start(self) -> None:
        if self._reader is not None:
            raise RuntimeError("PubSub hub started twice")
        self._pubsub = await self._connect()
        self._connected = True
        self._reader = asyncio.create_task(self._run(), name="redis-pubsub-reader")

    async def close(self) -> None:
        """Stops the reader, then drops the connection; subscribers are told through ``on_failure``."""
        reader, self._reader = self._reader, None
        if reader is not None:
            # A reader that failed earlier has reported it through on_failure already. Not while it
            # (re)connects, which holds the lock: a connect cut short leaves its socket open.
            async with self._lock:
                await cancel_and_wait(reader)
        await self._drop_connection()
        await self._pool.disconnect()
        self._fail_waiters(TransportError("the Redis PubSub hub was closed"))

    async def subscribe(self, channel: str) -> None:
        """Returns once Redis confirmed the subscription; raises ``TransportError`` if it cannot be."""
        counted = False
        try:
            async with self._lock:
                self._raise_if_unusable()
                count = self._refs.get(channel, 0)
                self._refs[channel] = count + 1
                counted = True
                if count == 0:
                    confirmed = asyncio.get_running_loop().create_future()
                    self._active[channel] = confirmed
                    self._pending.setdefault(channel, deque()).append(confirmed)
                    # A subscriber that leaves may be cancelled here: the send waits while the
                    # connection's write buffer drains.
                    await self._send("SUBSCRIBE", channel)
                else:
                    confirmed = self._active[channel]
            async with asyncio.timeout(self.subscribe_timeout_s):
                await asyncio.shield(confirmed)
        except TimeoutError as err:
            await asyncio.shield(self.unsubscribe(channel))
            raise TransportError(
                f"Redis did not confirm SUBSCRIBE {channel} within {self.subscribe_timeout_s} s"
            ) from err
        except BaseException:
            # Shielded: a subscriber that leaves is cancelled again until it ends (``cancel_and_wait``);
            # cut short while it waits for the lock (a reconnect), the channel would keep its reference.
            if counted:
                await asyncio.shield(self.unsubscribe(channel))
            raise

    async def unsubscribe(self, channel: str) -> None:
        """Drops one reference; the last one unsubscribes (without waiting for Redis to confirm)."""
        async with self._lock:
            count = self._refs.get(channel, 0) - 1
            if count > 0:
                self._refs[channel] = count
                return
            self._refs.pop(channel, None)
            self._active.pop(channel, None)
            if self._pubsub is not None and self.alive:
                self._unsubscribing[channel] = self._unsubscribing.get(channel, 0) + 1
                await self._send("UNSUBSCRIBE", channel)

    def channels(self) -> frozenset[str]:
        return frozenset(self._refs)

    def refs(self, channel: str) -> int:
        """How many subscribers hold ``channel`` here."""
        return self._refs.get(channel, 0)

    def forget(self, channel: str) -> None:
        """Drops ``channel`` with all its references, sending nothing: another hub took it over (and
        confirmed it), so a subscriber still waiting here goes on."""
        self._refs.pop(channel, None)
        confirmed = self._active.pop(channel, None)
        if confirmed is not None and not confirmed.done():
            confirmed.set_result(None)
        self._pending.pop(channel, None)

    async def _send(self, command: str, channel: str) -> None:
        """Sends without reading: the reader task owns every reply on this connection."""
        pubsub = self._pubsub
        if pubsub is None:
            # Between connections (a reconnect failed): the reader subscribes every channel still
            # referenced once it has a connection again, which confirms this one too.
            log.info("%s %s waits for the reader's reconnect", command, channel)
            return
        try:
            _raise_if_closed(pubsub)
            if command == "SUBSCRIBE":
                await (pubsub.ssubscribe(channel) if self._sharded else pubsub.subscribe(channel))
            else:
                await (pubsub.sunsubscribe(channel) if self._sharded else pubsub.unsubscribe(channel))
        except _SEND_ERRORS as err:
            # The reader sees the same broken connection, reconnects, and subscribes to every
            # channel still referenced, which confirms this one too (or the caller times out).
            log.info("%s %s not sent (%s); the reader will reconnect", command, channel, err)

    def _raise_if_unusable(self) -> None:
        if self._failure is not None:
            raise TransportError(f"the Redis PubSub reader failed: {self._failure!r}") from self._failure
        if self._reader is None:
            raise TransportError("the Redis PubSub hub is not started (or closed)")

    async def _connect(self) -> PubSub:
        pubsub = PubSub(self._pool, ignore_subscribe_messages=False)
        try:
            await pubsub.connect()  # type: ignore[no-untyped-call]  # untyped in redis-py
        except BaseException:
            await pubsub.aclose()
            raise
        return pubsub

    async def _drop_connection(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            await pubsub.aclose()

    async def _run(self) -> None:
        try:
            backoff = self.min_backoff_s
            while True:
                try:
                    await self._read()
                except _CONNECTION_ERRORS as err:
                    self._connected = False
                    if self._on_lost is not None:
                        self._on_lost()
                    log.warning(
                        "Redis PubSub connection lost (%s: %s); reconnecting in %.2f s, "
                        "then subscribing %d channel(s) again",
                        type(err).__name__,
                        err,
                        backoff,
                        len(self._refs),
                    )
                failures = 0
                while True:
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.max_backoff_s)
                    try:
                        channels = await self._reconnect()
                        break
                    except _CONNECTION_ERRORS as err:
                        failures += 1
                        self.failed_reconnects += 1
                        if told(failures):
                            log.warning(
                                "Redis PubSub reconnect failed (%d tries so far: %s%s); retrying every %.2f s at most",
                                failures,
                                err,
                                credentials_hint(err),
                                self.max_backoff_s,
                            )
                backoff = self.min_backoff_s
                self._connected = True
                log.warning("Redis PubSub reconnected; subscribed %d channel(s) again", len(channels))
                await self._on_resubscribed(channels)
                self.reconnects += 1
        except Exception as err:
            # Not a connection problem, so reconnecting would not help: fail every waiter loudly
            # rather than leave them hanging, and make ready() and new subscriptions fail.
            log.exception("Redis PubSub reader failed; watchers and reply listeners are told")
            self._failure = err
            self._fail_waiters(err)

    async def _reconnect(self) -> frozenset[str]:
        """A fresh connection subscribed to every referenced channel (the old one is dropped)."""
        async with self._lock:
            await self._drop_connection()
            pubsub = self._pubsub = await self._connect()
            channels = frozenset(self._refs)
            self._pending = {}
            self._unsubscribing = {}
            for channel in channels:
                self._pending[channel] = deque([self._active[channel]])
            if channels and self._sharded:
                # One SSUBSCRIBE per slot: Redis refuses one whose channels span slots (CROSSSLOT).
                for slot_channels in _by_slot(channels):
                    await pubsub.ssubscribe(*slot_channels)
            elif channels:
                await pubsub.subscribe(*channels)
            if channels:
                await self._confirmed(channels)
            return channels

    async def _confirmed(self, channels: frozenset[str]) -> None:
        """Reads until Redis confirmed every channel, so a re-read of state after this misses nothing."""
        assert self._pubsub is not None
        deadline = asyncio.get_running_loop().time() + self.subscribe_timeout_s
        while any(channel in self._pending for channel in channels):
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise RedisTimeoutError(f"SUBSCRIBE not confirmed within {self.subscribe_timeout_s} s")
            message = await self._message(self._pubsub, remaining)
            if message is not None:
                self._dispatch(message)

    async def _read(self) -> None:
        """Dispatches messages until the connection breaks; a PING unanswered for one interval breaks it."""
        pubsub = self._pubsub
        assert pubsub is not None
        awaiting_pong = False
        while True:
            message = await self._message(pubsub, self.ping_interval_s)
            if message is None:
                if awaiting_pong:
                    raise RedisTimeoutError(f"no answer to PING within {self.ping_interval_s} s")
                _raise_if_closed(pubsub)
                try:
                    await pubsub.ping()
                except RuntimeError as err:  # its transport was closed under it: a dropped connection
                    raise RedisConnectionError(f"PING not sent: {err}") from err
                awaiting_pong = True
                continue
            awaiting_pong = False
            self._dispatch(message)

    async def _message(self, pubsub: PubSub, timeout_s: float) -> dict[str, Any] | None:
        """The next message, None after ``timeout_s``. On a sharded hub a ``MOVED`` reply (an SSUBSCRIBE
        sent by an out-of-date slot map) hands the slot's channels to ``on_moved``; any other error reply
        counts as a lost connection, so that the slot map is read again and the channels move to their
        slots' owners (``ShardedHubs``)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            _raise_if_closed(pubsub)
            try:
                message: dict[str, Any] | None = await pubsub.get_message(
                    timeout=max(0.0, deadline - asyncio.get_running_loop().time())
                )
            except ResponseError as err:
                if not self._sharded:
                    raise
                if not isinstance(err, MovedError) or self._on_moved is None:
                    raise RedisConnectionError(f"Redis refused a subscription: {err}") from err
                moved = frozenset(channel for channel in self._refs if key_slot(channel.encode()) == err.slot_id)
                if moved:  # else it answers an SUNSUBSCRIBE, or a channel whose subscribers left
                    self._on_moved(moved)
                continue
            return message

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        channel_raw = message.get("channel")
        channel = channel_raw.decode() if isinstance(channel_raw, bytes) else str(channel_raw)
        if kind in ("message", "smessage"):
            data = message.get("data")
            if isinstance(data, bytes):
                self._on_message(channel, data)
        elif kind in ("subscribe", "ssubscribe"):
            # Confirmations come in the order the SUBSCRIBEs went out: one per entry.
            pending = self._pending.get(channel)
            if pending:
                confirmed = pending.popleft()
                if not confirmed.done():
                    confirmed.set_result(None)
                if not pending:
                    del self._pending[channel]
        elif kind in ("unsubscribe", "sunsubscribe"):
            sent = self._unsubscribing.pop(channel, 0)
            if sent > 1:
                self._unsubscribing[channel] = sent - 1
            elif not sent and kind == "sunsubscribe" and channel in self._refs:
                # Not ours: Redis ends the shard channels of a slot that left this node (a resharding, a
                # failover); the channel moves to the slot's owner.
                if self._on_moved is None:
                    raise RedisConnectionError(f"Redis ended the subscription of {channel}: its slot left this node")
                self._on_moved(frozenset({channel}))

    def _fail_waiters(self, err: BaseException) -> None:
        for confirmed in self._active.values():
            if not confirmed.done():
                confirmed.set_exception(TransportError(f"Redis PubSub unavailable: {err!r}"))
                confirmed.exception()  # retrieved here: a waiter may have gone already
        self._on_failure(err)


class ShardedHubs:
    """One sharded ``PubSubHub`` per Redis Cluster primary: each channel is subscribed (SSUBSCRIBE)
    on the primary that owns its slot, where the scripts that write its task SPUBLISH to it, so a
    message published before a subscription is confirmed never arrives after it.

    A failover is followed: when a hub loses its connection, the slot map is read again until its
    channels' slots have a new owner (or the hub is back); each moved channel is subscribed on the
    new owner's hub, with its references, and ``on_resubscribed`` re-reads what was missed. A hub
    that lost its connection and is left with no channel is closed. A resharding is followed the same
    way, channel by channel: a slot that left a node (Redis ends its subscriptions there, or answers
    ``MOVED``) moves its channels, and the hub keeps its connection and its other channels, so the
    feed stays connected meanwhile.
    """

    def __init__(
        self,
        cluster: RedisCluster,
        pool_of: Callable[[str, int], ConnectionPool],
        on_message: MessageHandler,
        on_resubscribed: ResubscribedHandler,
        on_failure: FailureHandler,
        *,
        ping_interval_s: float,
        subscribe_timeout_s: float,
        max_backoff_s: float = 1.0,
    ) -> None:
        self._cluster = cluster
        self._pool_of = pool_of
        self._on_message = on_message
        self._on_resubscribed = on_resubscribed
        self._on_failure = on_failure
        self.ping_interval_s = ping_interval_s
        self.subscribe_timeout_s = subscribe_timeout_s
        self.max_backoff_s = max_backoff_s
        self._hubs: dict[str, PubSubHub] = {}
        self._of: dict[str, PubSubHub] = {}  # channel -> the hub it is subscribed on
        self._lock = asyncio.Lock()
        self._moves = asyncio.Lock()  # a channel moves between hubs, or loses a reference, one at a time
        self._rehoming: dict[str, asyncio.Task[None]] = {}
        self._strays: dict[str, set[str]] = {}
        """Per node: channels whose slot Redis said left it, until they moved (``_moved``)."""
        self._retired_reconnects = 0
        self._started = False

    @property
    def reconnects(self) -> int:
        return self._retired_reconnects + sum(hub.reconnects for hub in self._hubs.values())

    @property
    def alive(self) -> bool:
        return self._started and all(hub.alive for hub in self._hubs.values())

    @property
    def connected(self) -> bool:
        return self._started and all(hub.connected for hub in self._hubs.values())

    async def start(self) -> None:
        await self._cluster.initialize()  # the slot map, which routes each channel
        self._started = True

    async def close(self) -> None:
        self._started = False
        rehoming, self._rehoming = self._rehoming, {}
        for task in rehoming.values():
            await cancel_and_wait(task)
        hubs, self._hubs = self._hubs, {}
        for hub in hubs.values():
            await hub.close()

    async def subscribe(self, channel: str) -> None:
        """On the hub that already holds ``channel`` (its references live there, and a failover moves
        them together), else on its slot's primary's."""
        if not self._started:
            raise TransportError("the Redis PubSub hubs are not started (or closed)")
        hub = self._of.get(channel)
        if hub is None or hub not in self._hubs.values():
            hub = await self._hub_of(channel)
        await hub.subscribe(channel)
        self._of.setdefault(channel, hub)  # unless a failover moved it meanwhile (``_move`` set its new hub)

    async def unsubscribe(self, channel: str) -> None:
        async with self._moves:
            hub = self._of.get(channel)
            if hub is not None:
                await hub.unsubscribe(channel)
                if channel not in hub.channels():
                    self._of.pop(channel, None)

    def channels(self) -> frozenset[str]:
        return frozenset(self._of)

    def _owner(self, channel: str) -> ClusterNode:
        """The primary that serves ``channel``'s slot, by the slot map as last read."""
        return self._cluster.nodes_manager.get_node_from_slot(key_slot(channel.encode()))

    async def _hub_of(self, channel: str) -> PubSubHub:
        """The hub on the primary that serves ``channel``'s slot, started on first use. A primary that
        does not answer (the slot map is out of date, mid-failover) raises ``TransportError`` after the
        slot map is read again, so that the caller's retry finds the new one."""
        try:
            node = self._owner(channel)
        except RedisClusterException as err:  # a slot no primary serves, mid-failover
            raise TransportError(f"subscribing to {channel}: {err}") from err
        async with self._lock:
            hub = self._hubs.get(node.name)
            if hub is not None:
                return hub
            name = node.name
            hub = PubSubHub(
                self._pool_of(node.host, int(node.port)),
                self._on_message,
                self._on_resubscribed,
                lambda err: self._failed(name, err),
                ping_interval_s=self.ping_interval_s,
                subscribe_timeout_s=self.subscribe_timeout_s,
                sharded=True,
                on_lost=lambda: self._lost(name),
                on_moved=lambda channels: self._moved(name, channels),
            )
            try:
                await hub.start()
            except (RedisError, OSError) as err:
                await hub.close()
                failure = err
            else:
                if not self._started:  # closed meanwhile: no one would close this one
                    await hub.close()
                    raise TransportError("the Redis PubSub hubs are closed")
                self._hubs[name] = hub
                return hub
        with contextlib.suppress(*REDIS_ERRORS, OSError):  # outside the lock: other nodes' hubs need not wait
            await self._cluster.nodes_manager.initialize()
        raise TransportError(f"subscribing to {channel} on Redis Cluster node {name}: {failure}") from failure

    def _failed(self, name: str, err: BaseException) -> None:
        """A hub's reader failed: the subscribers hear of it, unless the hub was retired (its channels moved)."""
        if name in self._hubs:
            self._on_failure(err)

    def _moved(self, name: str, channels: frozenset[str]) -> None:
        self._strays.setdefault(name, set()).update(channels)
        self._lost(name)

    def _astray(self, name: str, hub: PubSubHub) -> bool:
        """Whether ``hub`` still holds a channel whose slot Redis said left the node ``name``."""
        strays = self._strays.get(name, set())
        strays.intersection_update(hub.channels())
        return bool(strays)

    def _lost(self, name: str) -> None:
        task = self._rehoming.get(name)
        if self._started and (task is None or task.done()):
            task = asyncio.create_task(self._rehome(name), name=f"redis-pubsub-rehome-{name}")
            task.add_done_callback(_log_failure)
            self._rehoming[name] = task

    async def _rehome(self, name: str) -> None:
        """Until the hub on ``name`` is back, holds no channel whose slot left the node, or has no
        channel left: reads the slot map and moves the channels whose slots another primary now serves."""
        backoff = 0.05
        while (hub := self._hubs.get(name)) is not None and (not hub.connected or self._astray(name, hub)):
            try:
                await self._cluster.nodes_manager.initialize()
            except (*REDIS_ERRORS, OSError) as err:
                log.info("reading the Redis Cluster's slot map failed (%s); retrying", err)
            else:
                moved = await self._move(hub, [c for c in hub.channels() if self._owner(c).name != name])
                if not hub.channels() and not hub.connected:
                    del self._hubs[name]
                    self._strays.pop(name, None)
                    self._retired_reconnects += hub.reconnects
                    await hub.close()
                    log.warning("Redis Cluster node %s serves none of this process's channels now: hub closed", name)
                if moved:
                    log.warning("%d channel(s) moved to their slots' new primaries", len(moved))
                    await self._on_resubscribed(frozenset(moved))
                if name not in self._hubs:
                    return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    async def _move(self, hub: PubSubHub, channels: list[str]) -> list[str]:
        """Subscribes each of ``channels`` on its slot's owner with the references it had on ``hub``;
        returns those moved (one whose subscribe failed stays, for the next try)."""
        moved: list[str] = []
        for channel in channels:
            async with self._moves:
                if not hub.refs(channel):
                    continue  # its last subscriber left meanwhile
                taken = 0
                try:
                    target = await self._hub_of(channel)
                    # A subscriber may join on ``hub`` while these subscribe (``subscribe`` does not wait for
                    # ``_moves``): its reference moves too, or ``forget`` drops it and a leaver ends the channel.
                    while hub.refs(channel) > taken:
                        await target.subscribe(channel)
                        taken += 1
                except TransportError as err:
                    # The references taken there are dropped again: the next try takes them all anew.
                    for _ in range(taken):
                        await target.unsubscribe(channel)
                    log.warning("moving channel %s to its slot's new primary failed (%s); retrying", channel, err)
                    continue
                hub.forget(channel)
                self._of[channel] = target
                moved.append(channel)
        return moved


def _raise_if_closed(pubsub: PubSub) -> None:
    """A connection closed while the reader did not read it (a primary follower closes it) is a lost one:
    redis-py would reopen it and subscribe its channels again unseen, and nothing would re-read what was
    published meanwhile."""
    connection = pubsub.connection
    if connection is None or not connection.is_connected:
        raise RedisConnectionError("the PubSub connection was closed")


def _by_slot(channels: frozenset[str]) -> list[list[str]]:
    """``channels`` grouped by their cluster hash slot."""
    slots: dict[int, list[str]] = {}
    for channel in sorted(channels):
        slots.setdefault(key_slot(channel.encode()), []).append(channel)
    return list(slots.values())


def _log_failure(task: asyncio.Task[None]) -> None:
    """A rehoming that died: its channels stay on the lost hub, which goes on reconnecting; say why."""
    if not task.cancelled() and (err := task.exception()) is not None:
        log.error("following a Redis Cluster failover failed: %r", err, exc_info=err)
