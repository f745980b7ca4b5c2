"""The task store's change feed: watchers of one task and the reply channels of gateways.

Every store write publishes the new state on the task's channel and, for a terminal state, on the
reply channel of the gateway that waits for it, one message per write for all of a gateway's tasks
(``lua``). This module turns those messages
into what the store's callers see: a queue per watcher, a handler per reply channel, and, after the
feed reconnected, the watched tasks re-read (PubSub keeps nothing for a subscriber that is away)
and the ``on_feed_return`` callbacks run, so a gateway re-reads the callers it holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager

from redis.asyncio import ConnectionPool
from redis.asyncio.cluster import RedisCluster

from schemas.codec import CodecError, decode_state
from schemas.records import TaskState
from schemas.wire import Names
from telemetry.logs import ids
from transport.ports import ReplyHandler, TransportError
from transport.redis.lua import reply_frames
from transport.redis.pubsub import PubSubHub, ShardedHubs

log = logging.getLogger(__name__)

_Item = TaskState | TransportError
Reader = Callable[[Collection[str]], Awaitable[dict[str, TaskState]]]
"""Reads the stored states of task ids (the store's ``get_many``)."""


class ChangeFeed:
    """Task watchers and reply handlers over one ``PubSubHub`` (one connection, one reader task), or
    over ``ShardedHubs`` (one per Redis Cluster primary)."""

    def __init__(
        self,
        pool: ConnectionPool | RedisCluster,
        names: Names,
        read: Reader,
        *,
        ping_interval_s: float,
        subscribe_timeout_s: float,
        pool_of: Callable[[str, int], ConnectionPool] | None = None,
    ) -> None:
        """``pool``: the PubSub connection's; a cluster client instead gives one sharded hub per
        primary, each over ``pool_of(host, port)``."""
        self.names = names
        self._read = read
        handlers = (self._on_message, self._on_resubscribed, self._on_failure)
        self._hub: PubSubHub | ShardedHubs
        if isinstance(pool, RedisCluster):
            assert pool_of is not None, "a cluster's feed needs pool_of"
            self._hub = ShardedHubs(
                pool, pool_of, *handlers, ping_interval_s=ping_interval_s, subscribe_timeout_s=subscribe_timeout_s
            )
        else:
            self._hub = PubSubHub(
                pool, *handlers, ping_interval_s=ping_interval_s, subscribe_timeout_s=subscribe_timeout_s
            )
        self._watchers: dict[str, set[asyncio.Queue[_Item]]] = {}  # task channel -> watcher queues
        self._watched: dict[str, str] = {}  # task channel -> task id
        self._replies: dict[str, ReplyHandler] = {}  # reply channel -> handler
        self._undecodable = 0
        self._feed_return: list[Callable[[], None]] = []

    @property
    def reconnects(self) -> int:
        return self._hub.reconnects

    @property
    def connected(self) -> bool:
        return self._hub.connected

    async def start(self) -> None:
        await self._hub.start()

    async def close(self) -> None:
        """Stops the reader: every watcher gets a ``TransportError``."""
        await self._hub.close()

    @asynccontextmanager
    async def watch(self, task_id: str) -> AsyncIterator[AsyncIterator[TaskState]]:
        """Yields once Redis confirmed the subscription: read the stored state after entering."""
        channel = self.names.task_channel(task_id)
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._watchers.setdefault(channel, set()).add(queue)
        self._watched[channel] = task_id
        try:
            await self._hub.subscribe(channel)
            try:
                yield _iterate(queue)
            finally:
                # Shielded: a watcher that leaves is cancelled, and cancelled again until it ends
                # (``cancel_and_wait``); cut short while it waits for the hub's lock (a reconnect
                # subscribing every channel again), the channel would keep its reference for good.
                await asyncio.shield(self._hub.unsubscribe(channel))
        finally:
            watchers = self._watchers.get(channel)
            if watchers is not None:
                watchers.discard(queue)
                if not watchers:
                    del self._watchers[channel]
                    del self._watched[channel]

    async def listen_replies(self, gateway_id: str, handler: ReplyHandler) -> None:
        """Returns once subscribed; ``handler`` then runs in the reader task, so it must not block."""
        channel = self.names.reply_channel(gateway_id)
        known = channel in self._replies
        self._replies[channel] = handler
        if known:
            return
        try:
            await self._hub.subscribe(channel)
        except BaseException:
            self._replies.pop(channel, None)
            raise

    def on_feed_return(self, callback: Callable[[], None]) -> None:
        self._feed_return.append(callback)

    def _on_message(self, channel: str, data: bytes) -> None:
        handler = self._replies.get(channel)
        if handler is None:
            try:
                state = decode_state(data)
            except CodecError as err:
                self._count_undecodable(channel, err)
                return
            for queue in self._watchers.get(channel, ()):
                queue.put_nowait(state)
            return
        try:
            docs = reply_frames(data)
        except ValueError as err:
            self._count_undecodable(channel, err)
            return
        # Each frame on its own: one that another version wrote, or a damaged one, leaves its
        # message's other ends to reach their callers now rather than at the lost-reply sweep.
        for doc in docs:
            try:
                state = decode_state(doc)
            except CodecError as err:
                self._count_undecodable(channel, err)
                continue
            if not state.status.terminal:
                continue
            try:
                handler(state)
            except Exception:
                log.exception(
                    "reply handler failed for task %s on %s", state.task_id, channel, extra=ids(task_id=state.task_id)
                )

    def _count_undecodable(self, channel: str, err: Exception) -> None:
        self._undecodable += 1
        if self._undecodable % 100 == 1:
            log.warning("%d undecodable task event(s); latest on %s: %s", self._undecodable, channel, err)

    async def _on_resubscribed(self, channels: frozenset[str]) -> None:
        """States published while PubSub was down are lost: re-read the watched ones and hand them on.

        Watchers may see a state twice (states are idempotent). Replies published in that window
        cannot be recovered here (the feed does not know which tasks a gateway waits for): the
        ``on_feed_return`` callbacks run first, and a gateway re-reads the callers it holds
        (``gateway.answers.reconnect_recheck``).
        """
        for callback in self._feed_return:
            callback()
        watched = {self._watched[channel]: channel for channel in channels if channel in self._watched}
        if not watched:
            return
        try:
            states = await self._read(watched)
        except TransportError as err:
            log.warning("re-reading %d watched task(s) after a PubSub reconnect failed: %s", len(watched), err)
            return
        for task_id, state in states.items():
            for queue in self._watchers.get(watched[task_id], ()):
                queue.put_nowait(state)

    def _on_failure(self, err: BaseException) -> None:
        failure = TransportError(f"task events unavailable: {err}")
        for queues in self._watchers.values():
            for queue in queues:
                queue.put_nowait(failure)


async def _iterate(queue: asyncio.Queue[_Item]) -> AsyncIterator[TaskState]:
    while True:
        item = await queue.get()
        if isinstance(item, TransportError):
            raise item
        yield item
