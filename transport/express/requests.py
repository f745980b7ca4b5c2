"""Requests both ways (gateway -> batcher) at light load: the Kafka record and an express copy
published to the batcher that owns its partition. See ``transport.express.copies``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from schemas.codec import CodecError, decode_request, encode_request
from schemas.records import InferenceRequest
from schemas.wire import Names
from transport.cancelling import cancel_and_wait
from transport.express.copies import RedisExpress
from transport.kafka.producers import KafkaRequestProducer
from transport.ports import UNKNOWN, Delivered, PartitionsCallback, RequestConsumer, TransportError
from transport.redis.pools import pubsub_pool
from transport.redis.pubsub import PubSubHub

log = logging.getLogger(__name__)


class LightLoad:
    """Whether requests come slowly enough for express copies to pay (a moving average of the gaps).

    Under load, requests wait for a busy worker anyway and the batch forms meanwhile: a copy that
    comes a few milliseconds sooner changes nothing there, and would only cost CPU on every request.
    """

    def __init__(self, max_rps: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_rps = max_rps
        self.clock = clock
        self._last = float("-inf")
        self._gap_s = float("inf")

    def arrived(self) -> bool:
        """Notes one request; True while the moving rate stays at or under ``max_rps``."""
        now = self.clock()
        gap = min(now - self._last, 1.0)
        self._last = now
        self._gap_s = gap if self._gap_s == float("inf") else 0.9 * self._gap_s + 0.1 * gap
        return self._gap_s * self.max_rps >= 1.0


class ExpressRequestProducer:
    """``RequestProducer``: the Kafka record and, at light load, an express copy to its batcher.

    The copy is published, then Kafka takes the record. If Kafka refuses it, the gateway ends the
    task unless a worker started it (``Publisher._abandon``): an ended task's copy is not run, and a
    started one's answer is the caller's, with no 503.

    A synchronous request's record (one with a ``reply_to``: its caller waits for the answer, not
    for the record's acknowledgement) is produced ``record_delay_s`` after its copy. On a small
    machine the broker's append, and the batcher's and worker's reading of the record, would
    otherwise take CPU from the copy's few milliseconds to a GPU; delayed, that work happens while
    the GPU computes. An acknowledged submit (``POST /v1/tasks``) is not delayed.
    """

    def __init__(
        self,
        kafka: KafkaRequestProducer,
        express: RedisExpress,
        *,
        max_rps: float = 200.0,
        record_delay_s: float = 0.0,
    ) -> None:
        self.kafka = kafka
        self.express = express
        self.record_delay_s = record_delay_s
        self._load = LightLoad(max_rps)

    async def start(self) -> None:
        await self.express.start()
        await self.kafka.start()

    async def close(self) -> None:
        await self.kafka.close()
        await self.express.close()

    async def ready(self) -> bool:
        return await self.kafka.ready()

    def reachable(self) -> bool:
        return self.kafka.reachable()

    async def send(self, request: InferenceRequest) -> None:
        data = encode_request(request)
        partition = self.kafka.partitioner.choose(request.model)
        if not self._load.arrived():
            await self.kafka.send_encoded(data, partition, request.traceparent)
            return
        published = await self._publish(partition, data)  # first, as for batches (ExpressBatchProducer.send)
        if published and request.reply_to is not None and self.record_delay_s > 0:
            await asyncio.sleep(self.record_delay_s)
        await self.kafka.send_encoded(data, partition, request.traceparent)

    async def _publish(self, partition: int, data: bytes) -> bool:
        try:
            await self.express.publish(partition, data)
        except TransportError as err:  # the Kafka record still gets there
            log.debug("express copy of a request not published: %s", err)
            return False
        return True


class ExpressRequestConsumer:
    """``RequestConsumer``: the owned partitions' Kafka records, and the express copies published for them.

    A copy comes with ``via="express"`` and no offset, usually before its Kafka record; the batcher
    matches the two (``batcher.express.ExpressLedger``), so each request is batched once and its
    offset is committed only after its batch is on Kafka. Copies come over one PubSub connection
    that follows the partitions the group assigns; a copy lost on the way costs only its head start.
    """

    def __init__(
        self,
        kafka: RequestConsumer,
        redis_url: str,
        names: Names,
        *,
        max_waiting: int = 10_000,
        socket_timeout_s: float = 5.0,
    ) -> None:
        self.kafka = kafka
        self.names = names
        self.max_waiting = max_waiting
        self._hub = PubSubHub(
            pubsub_pool(redis_url, socket_timeout_s=socket_timeout_s),
            self._on_message,
            self._on_resubscribed,
            self._on_failure,
        )
        self._channels: dict[str, int] = {}
        self._copies: list[Delivered[InferenceRequest]] = []
        self._copied: asyncio.Future[None] | None = None
        """While a fetch waits with no copy in hand: done once one comes (a future, not a task per fetch)."""
        self._fetching: asyncio.Task[Sequence[Delivered[InferenceRequest]]] | None = None

    async def start(self, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback) -> None:
        async def assigned(partitions: frozenset[int]) -> None:
            await self._follow(partitions)
            await on_assigned(partitions)

        async def revoked(partitions: frozenset[int]) -> None:
            await self._unfollow(partitions)
            await on_revoked(partitions)

        await self._hub.start()
        await self.kafka.start(assigned, revoked)

    async def close(self) -> None:
        if self._fetching is not None:
            await cancel_and_wait(self._fetching)
            self._fetching = None
        await self.kafka.close()
        await self._hub.close()
        self._copies.clear()

    def assignment(self) -> frozenset[int]:
        return self.kafka.assignment()

    async def commit(self, offsets: Mapping[int, int]) -> None:
        await self.kafka.commit(offsets)

    async def fetch(self, timeout_s: float, max_records: int) -> Sequence[Delivered[InferenceRequest]]:
        if not self._copies:
            if self._fetching is None:
                self._fetching = asyncio.create_task(self.kafka.fetch(timeout_s, max_records))
            self._copied = asyncio.get_running_loop().create_future()
            either: set[asyncio.Future[Any]] = {self._fetching, self._copied}
            try:
                await asyncio.wait(either, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._copied = None
        records: list[Delivered[InferenceRequest]] = []
        if self._fetching is not None and self._fetching.done():
            fetched, self._fetching = self._fetching, None
            owned = self.kafka.assignment()  # a partition revoked since is read again by its new owner
            records.extend(record for record in fetched.result() if record.partition in owned)
        records.extend(self._copies)
        self._copies = []
        return records

    async def _follow(self, partitions: frozenset[int]) -> None:
        for partition in partitions:
            channel = self.names.express_channel(partition)
            if channel in self._channels:
                continue
            try:
                await self._hub.subscribe(channel)
            except TransportError as err:  # the Kafka records still come
                log.warning("no express copies for request partition %d: %s", partition, err)
                continue
            self._channels[channel] = partition

    async def _unfollow(self, partitions: frozenset[int]) -> None:
        for channel, partition in list(self._channels.items()):
            if partition in partitions:
                del self._channels[channel]
                await self._hub.unsubscribe(channel)
        self._copies = [copy for copy in self._copies if copy.partition not in partitions]

    def _on_message(self, channel: str, data: bytes) -> None:
        partition = self._channels.get(channel)
        if partition is None or len(self._copies) >= self.max_waiting:
            return  # not ours (any more), or the batcher is behind: the Kafka record follows
        try:
            request = decode_request(data)
        except CodecError:
            return
        self._copies.append(Delivered(request, partition, UNKNOWN, via="express"))
        if self._copied is not None and not self._copied.done():
            self._copied.set_result(None)

    async def _on_resubscribed(self, channels: frozenset[str]) -> None:
        return None  # copies published meanwhile are lost; their Kafka records are not

    def _on_failure(self, err: BaseException) -> None:
        log.warning("express request copies stopped (%r); Kafka alone carries the requests now", err)
