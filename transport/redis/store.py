"""The Redis task store: status, results and change notifications (the credit pool is ``credits``).

A task is a hash ``names.task_key(id)`` with ``status``, ``rank``, ``doc`` (Avro ``TaskState``) and,
when it has one, ``owner`` (written once, at create), expiring ``ttl_s`` after it ended (while it
runs, ``ttl_s`` after it was first stored).
Every write is a Lua script (``lua``) that checks that status only moves forward, stores, and
publishes the new state on the task's channel (and, for a terminal state, on the reply channel of
the gateway that waits for it), all in one round trip. Notifications reach this process through its
change feed (``feed.ChangeFeed``: one PubSub connection). Idempotency keys are plain strings
(``names.idempotency_key``) holding ``lua.binding``, kept the TTL past their task's deadline and
``ports.STALE_AFTER_MS`` (``ports.binding_ttl_ms``), since its result is kept the TTL past its end:
the script that writes the end cannot reach the key, which lives in another hash slot.

Over Redis Cluster (a ``redis+cluster://`` URL) each write script runs once per hash slot of the
keys it writes, concurrently. A task's channel shares its key's hash tag, so the script publishes
it with SPUBLISH on the node that holds the task, where the feed subscribed it (``ShardedHubs``);
the scripts return the reply frames instead, and they go out with one SPUBLISH per gateway's reply
channel. A write that waits for replicas (``apply_replicated``) runs, per primary, one pipeline of
its script calls; the reply frames go out, and then, per primary, a mark and ``WAIT``, which counts
the writes of its own connection (the mark, written after the scripts' writes).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from typing import Any

from redis.asyncio.client import Pipeline, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.commands.core import AsyncScript
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, RedisError

from schemas.codec import CodecError, decode_state, encode_state
from schemas.records import TaskState, TaskStatus
from schemas.wire import Names
from telemetry import metrics
from transport.coalesce import Coalescer
from transport.errors import PermanentTransportError, StoreFullError
from transport.ports import KeyClaim, ReplyHandler, TransportError, binding_ttl_ms
from transport.redis import scripted
from transport.redis.feed import ChangeFeed
from transport.redis.lua import (
    APPLY,
    CANCEL,
    CLAIM_KEY,
    CREATE,
    PUBLISH,
    REBIND_KEY,
    RELEASE_KEY,
    ROW,
    SPUBLISH,
    apply_args,
    binding,
    cancel_args,
    create_args,
    parse_binding,
)
from transport.redis.pools import (
    REDIS_ERRORS,
    KeyedClient,
    NodeClients,
    PoolOptions,
    is_cluster_url,
    node_pubsub_pool,
    pubsub_pool,
    redacted,
    translate,
)
from transport.redis.sentinel import PrimaryFollower
from transport.redis.write_refusal import WriteRefusalWatch

STORE_POOL = PoolOptions(max_connections=32)  # every gateway request and worker batch writes through it

log = logging.getLogger(__name__)


class RedisTaskStore:
    """``TaskStore`` over Redis: monotonic status per task, change events over PubSub.

    The connection pool (``pool``) serves short commands only; a full pool makes callers wait up
    to its ``pool_timeout_s`` rather than fail a burst. Watching costs no connection:
    all watchers and reply listeners share the hub's one PubSub connection.
    """

    def __init__(
        self,
        redis_url: str,
        names: Names,
        *,
        ttl_s: float = 3600.0,
        pool: PoolOptions = STORE_POOL,
        ready_timeout_s: float = 0.5,
        subscribe_timeout_s: float = 5.0,
        ping_interval_s: float = 5.0,
        refusal_watch_s: float | None = None,
        follower: PrimaryFollower | None = None,
    ) -> None:
        """``refusal_watch_s``: how often to ask whether Redis refuses writes (None: never, for roles that admit
        nothing); ``follower``: behind Sentinel, the one the process's pools share (``follower_of``)."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.redis_url = redis_url
        self.names = names
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.ready_timeout_s = ready_timeout_s
        self._cluster = is_cluster_url(redis_url)
        self._publish = SPUBLISH if self._cluster else PUBLISH
        self._commands = KeyedClient(redis_url, pool, follower=follower)
        self._client = self._commands.redis
        self._primaries = NodeClients(redis_url, pool) if self._cluster else None
        """Over a cluster: a plain client per primary, for the pipelines that end in ``WAIT``."""
        self._create = self._client.register_script(CREATE)
        self._creates: Coalescer[TaskState, bool] = Coalescer(self._create_many)
        self._apply = self._client.register_script(APPLY)
        self._cancel = self._client.register_script(CANCEL)
        self._claim_key = self._client.register_script(CLAIM_KEY)
        self._rebind_key = self._client.register_script(REBIND_KEY)
        self._release_key = self._client.register_script(RELEASE_KEY)
        self._feed = ChangeFeed(
            self._client
            if isinstance(self._client, RedisCluster)
            else pubsub_pool(redis_url, socket_timeout_s=pool.socket_timeout_s, follower=follower),
            names,
            self.get_many,
            ping_interval_s=ping_interval_s,
            subscribe_timeout_s=subscribe_timeout_s,
            pool_of=functools.partial(node_pubsub_pool, redis_url, socket_timeout_s=pool.socket_timeout_s),
        )
        self._refusal = WriteRefusalWatch(self._client, refusal_watch_s)

    @property
    def reconnects(self) -> int:
        """How often the PubSub connection was re-established (for metrics)."""
        return self._feed.reconnects

    async def start(self) -> None:
        """Reads a cluster's slot map, connects the PubSub hub (a failure here names the server) and
        starts its reader task."""
        try:
            await self._commands.start()
            await self._feed.start()
        except TransportError:
            await self._commands.close()
            raise
        except (*REDIS_ERRORS, OSError) as err:
            await self._commands.close()
            raise TransportError(f"cannot connect to Redis at {redacted(self.redis_url)}: {err}") from err
        await self._refusal.start()

    async def close(self) -> None:
        """Stops the reader (watchers get a ``TransportError``), then closes every connection."""
        await self._refusal.close()
        await self._creates.close(TransportError("the task store was closed"))
        await self._feed.close()
        await self._commands.close()
        if self._primaries is not None:
            await self._primaries.close()

    async def create(self, state: TaskState) -> bool:
        return await self._creates(state)  # with the creates of other requests in flight (coalesce.py)

    async def _create_many(self, states: list[TaskState]) -> list[bool]:
        keys = [self.names.task_key(state.task_id) for state in states]
        rows = [(state, encode_state(state), self.names.task_channel(state.task_id)) for state in states]
        try:
            created = await self._run(self._create, keys, create_args(self.ttl_ms, rows, self._publish), head=1)
        except REDIS_ERRORS as err:
            what = f"task {states[0].task_id}" if len(states) == 1 else f"{len(states)} tasks"
            raise translate(f"creating {what}", err) from err
        return [bool(flag) for flag in created]

    async def apply(self, updates: Sequence[TaskState], *, counted: bool = True) -> list[bool]:
        if not updates:
            return []
        keys, args = self._apply_call(updates)
        stored = functools.partial(_count_applied, updates) if counted else None
        try:
            applied = await self._run(self._apply, keys, args, head=2, stored=stored)
        except REDIS_ERRORS as err:
            raise translate(f"applying {len(updates)} task update(s)", err) from err
        return [bool(flag) for flag in applied]

    async def _run(
        self,
        script: AsyncScript,
        keys: list[str],
        args: list[Any],
        *,
        head: int,
        stored: Callable[[Iterable[int], Sequence[Any]], None] | None = None,
    ) -> list[int]:
        """One call of a write script (``args``: ``head`` values, ``lua.ROW`` per key, the publish
        command); over a cluster, one call per hash slot of ``keys``, concurrently, the results in the
        keys' order, and then one SPUBLISH per reply channel of the reply frames they returned.
        ``stored`` gets each call's keys' indexes and reply as it comes, whichever other call fails."""
        if not self._cluster:
            out = list(await script(keys=keys, args=args))
            if stored is not None:
                stored(range(len(keys)), out)
            return out
        slots: dict[int, list[int]] = {}
        for index, key in enumerate(keys):
            slots.setdefault(key_slot(key.encode()), []).append(index)
        results: list[int] = [0] * len(keys)
        replies: dict[bytes, list[bytes]] = {}

        async def one(indexes: list[int]) -> None:
            call_keys, call_args = self._slot_call(keys, args, indexes, head=head)
            out = await script(keys=call_keys, args=call_args)
            if stored is not None:
                stored(indexes, out)
            for index, result in zip(indexes, out, strict=False):
                results[index] = int(result)
            _gather_frames(out[len(indexes) :], replies)

        try:
            await self._each(one(indexes) for indexes in slots.values())
        finally:  # the slots written answer their callers, whichever other slot failed
            await self._send_replies(replies)
        return results

    async def _send_replies(self, frames: dict[bytes, list[bytes]]) -> None:
        """The reply frames the write scripts returned over a cluster: one SPUBLISH per gateway channel."""
        await self._each(self._client.spublish(channel, b"".join(parts)) for channel, parts in frames.items())

    @staticmethod
    def _slot_call(keys: list[str], args: list[Any], indexes: list[int], *, head: int) -> scripted.Call:
        """The part of a write script's call (``head`` values, ``lua.ROW`` per key, the publish command)
        that writes the keys at ``indexes``."""
        rows = [value for i in indexes for value in args[head + i * ROW : head + (i + 1) * ROW]]
        return [keys[i] for i in indexes], [*args[:head], *rows, *args[head + len(keys) * ROW :]]

    @staticmethod
    async def _each(calls: Iterable[Awaitable[Any]]) -> None:
        """Runs ``calls`` concurrently, each to its end (a script another call's failure cancelled may
        have written all the same, its replies unread); then the first error is raised as the one call
        would raise it."""
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome

    def _apply_call(self, updates: Sequence[TaskState]) -> tuple[list[str], list[Any]]:
        keys: list[str] = []
        rows: list[tuple[TaskState, bytes, str, str]] = []
        for state in updates:
            keys.append(self.names.task_key(state.task_id))
            reply_channel = self.names.reply_channel(state.reply_to) if state.reply_to is not None else ""
            rows.append((state, encode_state(state), self.names.task_channel(state.task_id), reply_channel))
        return keys, apply_args(self.ttl_ms, rows, self._publish)

    async def connected_replicas(self) -> int:
        """How many replicas the primary counts as connected and in sync now (``INFO replication``);
        over a cluster, the fewest any primary counts.

        A replica still taking its first full copy (a restarted one rejoining) acknowledges nothing
        until it has it, so it is not counted. Behind Sentinel, a count of none is trusted only from a
        server the Sentinels confirm as primary (``KeyedClient.confirm_primary``), else it counts one:
        an old primary that lost its replica to the promotion counts none, and would be trusted with
        states it drops once demoted. A count of one or more is asked for as it is, without the
        confirmation, which waits for every Sentinel: a silent one would hold each count (and the
        worker's results behind it) for its whole timeout."""
        try:
            if not isinstance(self._client, RedisCluster):
                if online := _online(await self._client.info("replication")):
                    return online
                if not await self._commands.confirm_primary():
                    return 1
                # Read again: the confirmation closed any connection to a server it no longer names.
                return _online(await self._client.info("replication"))
            return min([_online(await self._on(node).info("replication")) for node in self._client.get_primaries()])
        except REDIS_ERRORS as err:
            raise await self._translated("asking Redis how many replicas it has", err) from err

    async def apply_replicated(self, updates: Sequence[TaskState], replicas: int, timeout_ms: int) -> int:
        """``apply``, then Redis ``WAIT``: how many replicas acknowledged the updates within ``timeout_ms``
        (over a cluster, the fewest of any primary that holds some of them).

        ``WAIT`` counts only its own connection's writes. An update already applied writes nothing, so a
        mark written after the updates, on the connection that waits, makes the wait cover them wherever
        they were written on that primary before. On one Redis, one pipeline (one round trip:
        ``scripted``): the script, which publishes the reply frames, the mark and ``WAIT``. Over a
        cluster, per primary that holds some of the updates, one pipeline of its slots' script calls;
        once every primary's is in, the reply frames go out, and then each primary's mark and ``WAIT``
        on the same node: a slow replica delays the commit behind the wait, not the caller's answer,
        as on one Redis.
        """
        keys, args = self._apply_call(updates)

        def then(mark: str) -> Callable[[Pipeline], None]:
            def queue(pipe: Pipeline) -> None:
                pipe.set(mark, b"1", px=self.ttl_ms)
                pipe.wait(replicas, timeout_ms)

            return queue

        try:
            if not isinstance(self._client, RedisCluster):
                replies = await scripted.replies_of(
                    self._client, self._apply, [(keys, args)], then(self.names.replication_mark)
                )
                if keys and not isinstance(replies[0], Exception):  # stored, whether or not the wait failed
                    _count_applied(updates, range(len(keys)), replies[0])
                scripted.raise_first(replies)
                return int(replies[-1])
            if not keys:
                return replicas  # nothing written, nothing to wait for
            frames: dict[bytes, list[bytes]] = {}
            acked: list[int] = []
            primaries = self._by_primary(keys).values()

            async def stored_on(node: ClusterNode, slots: dict[int, list[int]]) -> None:
                calls = [self._slot_call(keys, args, indexes, head=2) for indexes in slots.values()]
                replies = await scripted.replies_of(self._on(node), self._apply, calls, lambda pipe: None)
                for indexes, out in zip(slots.values(), replies, strict=False):
                    if not isinstance(out, Exception):  # a slot stored, whichever other slot failed
                        _count_applied(updates, indexes, out)
                        _gather_frames(out[len(indexes) :], frames)
                scripted.raise_first(replies)

            async def waited_on(node: ClusterNode, slots: dict[int, list[int]]) -> None:
                pipe = self._on(node).pipeline(transaction=False)
                then(self.names.replication_mark_of(updates[next(iter(slots.values()))[0]].task_id))(pipe)
                acked.append(int((await pipe.execute())[-1]))

            try:
                await self._each(stored_on(node, slots) for node, slots in primaries)
            finally:  # as in ``_run``: the slots written answer their callers
                await self._send_replies(frames)
            await self._each(waited_on(node, slots) for node, slots in primaries)
            return min(acked)
        except REDIS_ERRORS as err:
            what = f"storing {len(updates)} task update(s) on {replicas} replica(s)"
            raise await self._translated(what, err) from err

    def _on(self, node: ClusterNode) -> Redis:
        """The plain client to one primary of the cluster."""
        assert self._primaries is not None
        return self._primaries.of(node.host, int(node.port))

    def _by_primary(self, keys: list[str]) -> dict[str, tuple[ClusterNode, dict[int, list[int]]]]:
        """The keys' indexes by hash slot, by the primary that serves the slot (the cluster's slot map)."""
        assert isinstance(self._client, RedisCluster)
        nodes = self._client.nodes_manager
        grouped: dict[str, tuple[ClusterNode, dict[int, list[int]]]] = {}
        for index, key in enumerate(keys):
            slot = key_slot(key.encode())
            node = nodes.get_node_from_slot(slot)
            grouped.setdefault(node.name, (node, {}))[1].setdefault(slot, []).append(index)
        return grouped

    async def _translated(self, what: str, err: RedisError | RedisClusterException) -> TransportError:
        """``err`` as a ``TransportError``; over a cluster, after one that a retry may cure, the slot
        map is read again first, since a primary that moved (a failover) answers the direct
        connections with an error. A script's error or a full store leave the map alone."""
        translated = translate(what, err)
        if isinstance(self._client, RedisCluster) and not isinstance(
            translated, (PermanentTransportError, StoreFullError)
        ):
            with contextlib.suppress(*REDIS_ERRORS):
                await self._client.nodes_manager.initialize()
        return translated

    async def cancel(
        self, task_id: str, reason_code: str, message: str, status: TaskStatus = TaskStatus.CANCELLED
    ) -> TaskState | None:
        """Reads the task, then lets one script decide and write (see ``lua.CANCEL``): two round
        trips, and a worker's ``running`` racing in between wins or loses as a whole."""
        current = await self.get(task_id)
        if current is None or current.status.rank > TaskStatus.BATCHED.rank:
            return current
        cancelled = replace(
            current,
            status=status,
            updated_at_ms=time.time_ns() // 1_000_000,
            error_code=reason_code,
            error_message=message,
        )
        reply_channel = self.names.reply_channel(current.reply_to) if current.reply_to is not None else ""
        args = cancel_args(
            self.ttl_ms,
            cancelled,
            encode_state(cancelled),
            self.names.task_channel(task_id),
            reply_channel,
            self._publish,
        )
        try:
            outcome: list[Any] = await self._cancel(keys=[self.names.task_key(task_id)], args=args)
        except REDIS_ERRORS as err:
            raise translate(f"cancelling task {task_id}", err) from err
        if outcome[0] == 1:
            metrics.count_ended([cancelled])
            if len(outcome) == 3:  # over a cluster: the reply frame, for its gateway's channel
                try:
                    await self._client.spublish(outcome[1], outcome[2])
                except REDIS_ERRORS as err:
                    raise translate(f"answering the cancel of task {task_id}", err) from err
            return cancelled
        if outcome[0] == -1:
            return None  # expired between the read and the script
        return self._decode_stored(task_id, outcome[1], outcome[2] if len(outcome) > 2 else None)

    async def claim_key(
        self, scope: str, key: str, task_id: str, fingerprint: str, deadline_ms: int | None = None
    ) -> KeyClaim:
        value = binding(fingerprint, deadline_ms, task_id)
        return await self._key_script(self._claim_key, "claiming", scope, key, deadline_ms, value)

    async def rebind_key(
        self, scope: str, key: str, ended_task_id: str, task_id: str, fingerprint: str, deadline_ms: int | None = None
    ) -> KeyClaim:
        value = binding(fingerprint, deadline_ms, task_id)
        return await self._key_script(self._rebind_key, "re-claiming", scope, key, deadline_ms, ended_task_id, value)

    async def _key_script(
        self, script: Any, what: str, scope: str, key: str, deadline_ms: int | None, *args: str
    ) -> KeyClaim:
        """Runs a key script (``CLAIM_KEY``, ``REBIND_KEY``): the binding that holds afterwards. A new
        binding expires ``binding_ttl_ms`` from now, as its task may end as late as its deadline."""
        name = self.names.idempotency_key(scope, key)
        ttl_ms = binding_ttl_ms(self.ttl_ms, deadline_ms, time.time_ns() // 1_000_000)
        try:
            held = await script(keys=[name], args=[ttl_ms, *args])
        except REDIS_ERRORS as err:
            raise translate(f"{what} an idempotency key", err) from err
        text = held.decode() if isinstance(held, bytes) else str(held)
        if (claim := parse_binding(text)) is None:
            raise PermanentTransportError(f"idempotency key {name} holds {text!r}")
        return claim

    async def release_key(self, scope: str, key: str, task_id: str) -> None:
        try:
            await self._release_key(keys=[self.names.idempotency_key(scope, key)], args=[task_id])
        except REDIS_ERRORS as err:
            raise translate("releasing an idempotency key", err) from err

    async def get(self, task_id: str) -> TaskState | None:
        try:
            doc, owner = await self._client.hmget(self.names.task_key(task_id), ["doc", "owner"])
        except REDIS_ERRORS as err:
            raise translate(f"reading task {task_id}", err) from err
        return None if doc is None else self._decode_stored(task_id, doc, owner)

    async def get_many(self, task_ids: Collection[str]) -> dict[str, TaskState]:
        """Every found task in one round trip (a pipeline of HMGETs, no transaction).

        A stored state that does not decode is logged and left out, so that one record (another
        version's, or a damaged one) does not stop the sweeps that read many tasks from answering the
        others; ``get`` of that task alone raises."""
        ids = list(dict.fromkeys(task_ids))
        if not ids:
            return {}
        pipe = self._client.pipeline(transaction=False)
        for task_id in ids:
            pipe.hmget(self.names.task_key(task_id), ["doc", "owner"])
        try:
            rows: list[Any] = await pipe.execute()
        except REDIS_ERRORS as err:
            raise translate(f"reading {len(ids)} task(s)", err) from err
        found: dict[str, TaskState] = {}
        for task_id, (doc, owner) in zip(ids, rows, strict=True):
            if doc:
                try:
                    found[task_id] = self._decode_stored(task_id, doc, owner)
                except PermanentTransportError as err:
                    log.warning("%s; left out of a read of %d task(s)", err, len(ids))
        return found

    def _decode_stored(self, task_id: str, doc: bytes | str, owner: bytes | str | None = None) -> TaskState:
        try:
            state = decode_state(doc if isinstance(doc, bytes) else doc.encode())
        except CodecError as err:
            raise PermanentTransportError(f"stored state of task {task_id} cannot be read: {err}") from err
        if owner is not None and state.owner is None:
            state = replace(state, owner=owner.decode() if isinstance(owner, bytes) else owner)
        return state

    def watch(self, task_id: str) -> AbstractAsyncContextManager[AsyncIterator[TaskState]]:
        """Yields once Redis confirmed the subscription: read the stored state after entering."""
        return self._feed.watch(task_id)

    async def listen_replies(self, gateway_id: str, handler: ReplyHandler) -> None:
        """Returns once subscribed; ``handler`` then runs in the feed's reader task, so it must not block."""
        await self._feed.listen_replies(gateway_id, handler)

    def reachable(self) -> bool:
        return self._feed.connected

    def on_feed_return(self, callback: Callable[[], None]) -> None:
        self._feed.on_feed_return(callback)

    def full(self, model: str) -> str | None:
        return None  # Redis keeps its own memory limit (maxmemory): ``refuses_writes``

    def refuses_writes(self) -> str | None:
        return self._refusal.refusal

    async def ready(self) -> bool:
        """The change feed is connected and Redis answers PING within ``ready_timeout_s``.

        A Redis that answers PING again while the feed still waits out its reconnect backoff is not
        ready yet: the gateway refuses requests that need the feed (``reachable``) until it is back."""
        if not self.reachable():
            return False
        try:
            async with asyncio.timeout(self.ready_timeout_s):
                return bool(await self._client.ping())
        except (TimeoutError, *REDIS_ERRORS, OSError):
            return False


def _online(info: dict[str, Any]) -> int:
    """The replicas an ``INFO replication`` reply counts as connected and in sync."""
    replicas = (info.get(f"slave{index}") for index in range(int(info.get("connected_slaves", 0))))
    return sum(1 for replica in replicas if isinstance(replica, dict) and replica.get("state") == "online")


def _count_applied(updates: Sequence[TaskState], indexes: Iterable[int], flags: Sequence[Any]) -> None:
    """Counts the ends among ``updates`` at ``indexes`` that ``APPLY``'s reply (``flags``, in their
    order) says it wrote."""
    metrics.count_ended(updates[index] for index, flag in zip(indexes, flags, strict=False) if flag == 1)


def _gather_frames(pairs: list[Any], into: dict[bytes, list[bytes]]) -> None:
    """The reply frames a write script returned over a cluster (channel, frames, ...), by channel."""
    for channel, frames in zip(pairs[::2], pairs[1::2], strict=True):
        into.setdefault(channel, []).append(frames)
