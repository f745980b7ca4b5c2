"""Express copies over Redis beside the Kafka records: faster hops at light load, Kafka stays the record.

Batches (batcher -> worker) and, at light load, requests (gateway -> batcher) take both ways.

Batches: a batch reaches its idle worker over Redis while Kafka takes the durable copy.

Over Kafka a batch crosses the broker (produce, append, the worker's parked fetch) in 2-5 ms on a
lightly loaded machine, where a push to a Redis list that the worker's BLPOP waits on takes under
1 ms. At low load that hop is a visible part of every request's latency, so the batcher sends each
batch both ways at once (to the list of the worker whose credit it spends) and the worker runs
whichever copy comes first:

* Kafka stays the record. The batcher commits its requests only once Kafka took the batch, and the
  worker commits a batch it ran from the express list only at its Kafka copy's offset, after the
  results are stored (a copy that is late is not waited for long: any later commit covers it).
* Each batch runs once: copies are matched by batch id, and the second to come is dropped.
* The express list only speeds things up. A worker clears its list when it starts (what an earlier
  run of it held comes again from Kafka), entries expire, and when Redis is slow Kafka's copy wins.
* If Kafka refuses a batch, the batcher takes the express copy back; if the worker took it already
  it runs it, so the batcher sends that same batch to Kafka until it lands rather than hand its
  items to another worker as well.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError

from batchwire.retry import pause, retry
from batchwire.transport.base import (
    EXPRESS,
    BatchConsumer,
    BatchProducer,
    Delivered,
    PartitionsCallback,
    RequestConsumer,
    TransportError,
)
from batchwire.transport.kafka import KafkaRequestProducer
from batchwire.transport.redis_pools import CommandClient, PoolOptions, blocking_pool, pubsub_pool, translate
from batchwire.transport.redis_pubsub import PubSubHub
from schemas.codec import CodecError, decode_batch, decode_request, encode_batch, encode_request
from schemas.records import Batch, Credit, InferenceRequest
from schemas.wire import Names

log = logging.getLogger(__name__)

EXPRESS_POOL = PoolOptions(max_connections=4)


class RedisExpress:
    """The express lists: one Redis list per worker, pushed by batchers and popped by that worker."""

    def __init__(self, redis_url: str, names: Names, *, ttl_s: float = 30.0, pool: PoolOptions = EXPRESS_POOL) -> None:
        self.names = names
        self.ttl_ms = int(ttl_s * 1000)
        self.pool = pool
        self._commands = CommandClient(redis_url, pool)
        self._blocking_pool = blocking_pool(redis_url, 1, pool)
        self._blocking = Redis(connection_pool=self._blocking_pool)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        await self._commands.close()
        await self._blocking.aclose()
        await self._blocking_pool.disconnect()

    async def push(self, worker_id: str, data: bytes) -> None:
        key = self.names.express_list(worker_id)
        try:
            async with self._commands.redis.pipeline(transaction=False) as pipe:
                pipe.rpush(key, data)
                pipe.pexpire(key, self.ttl_ms)  # a list whose worker is gone does not outlive it for long
                await pipe.execute()
        except RedisError as err:
            raise translate(f"pushing an express batch to {key}", err) from err

    async def publish(self, partition: int, data: bytes) -> None:
        """Publishes an express copy of a request to the batcher that owns its partition."""
        channel = self.names.express_channel(partition)
        try:
            await self._commands.redis.publish(channel, data)
        except RedisError as err:
            raise translate(f"publishing an express request to {channel}", err) from err

    async def retract(self, worker_id: str, data: bytes) -> bool:
        """Takes a pushed batch back; False when its worker popped it already."""
        key = self.names.express_list(worker_id)
        try:
            return bool(await self._commands.redis.lrem(key, 1, data))  # type: ignore[arg-type]
        except RedisError as err:
            raise translate(f"taking an express batch back from {key}", err) from err

    async def clear(self, worker_id: str) -> None:
        key = self.names.express_list(worker_id)
        try:
            await self._commands.redis.delete(key)
        except RedisError as err:
            raise translate(f"clearing {key}", err) from err

    async def pop(self, worker_id: str, timeout_s: float) -> bytes | None:
        key = self.names.express_list(worker_id)
        try:
            async with asyncio.timeout(timeout_s + self.pool.socket_timeout_s):
                popped = await self._blocking.blpop([key], timeout=timeout_s)
        except TimeoutError as err:
            raise TransportError(f"BLPOP {key} got no answer within {timeout_s:.1f} s: is Redis reachable?") from err
        except RedisError as err:
            raise translate(f"popping an express batch from {key}", err) from err
        if popped is None:
            return None
        value = popped[1]
        return value if isinstance(value, bytes) else value.encode()


class ExpressBatchProducer:
    """``BatchProducer``: the Kafka copy, and an express copy to the worker the batch's credit names."""

    def __init__(self, kafka: BatchProducer, express: RedisExpress, *, retry_max_s: float = 2.0) -> None:
        self.kafka = kafka
        self.express = express
        self.retry_max_s = retry_max_s

    async def start(self) -> None:
        await self.express.start()
        await self.kafka.start()

    async def close(self) -> None:
        await self.kafka.close()
        await self.express.close()

    async def send(self, batch: Batch, partition: int) -> None:
        if batch.credit is None:
            await self.kafka.send(batch, partition)
            return
        worker = Credit.worker_of(batch.credit)
        data = encode_batch(batch)
        # The copy first, then the record: on a small machine the broker's work for the record would
        # otherwise compete for the CPU with the copy's hop and the worker's start.
        pushed = await self._push(worker, data)
        try:
            await self.kafka.send(batch, partition)
        except TransportError as err:
            if not pushed or await self._retract(worker, data):
                raise
            log.warning(
                "Kafka refused batch %s (%s); its worker runs it already, so sending it again", batch.batch_id, err
            )
            await retry(
                log,
                "express",
                f"sending batch {batch.batch_id} to Kafka",
                lambda: self.kafka.send(batch, partition),
                self.retry_max_s,
            )

    async def _push(self, worker: str, data: bytes) -> bool:
        try:
            await self.express.push(worker, data)
        except TransportError as err:  # Kafka's copy still gets there
            log.debug("express copy to %s not sent: %s", worker, err)
            return False
        return True

    async def _retract(self, worker: str, data: bytes) -> bool:
        try:
            return await self.express.retract(worker, data)
        except TransportError as err:
            log.warning("could not take an express batch back from %s: %s", worker, err)
            return False  # it may have been taken: the safe side is to land it on Kafka


_MISSING = object()


class ExpressBatchConsumer:
    """``BatchConsumer``: a worker's batches from its Kafka partitions and its express list, each once.

    Two owned tasks read the two sources into one queue. A batch id seen before is not queued
    again, except a Kafka record read anew after a rebalance (a redelivery, as without express).
    """

    def __init__(
        self,
        kafka: BatchConsumer,
        express: RedisExpress,
        worker_id: str,
        *,
        confirm_timeout_s: float = 2.0,
        read_ahead: int = 4,
        remember: int = 1024,
        retry_max_s: float = 2.0,
    ) -> None:
        self.kafka = kafka
        self.express = express
        self.worker_id = worker_id
        self.confirm_timeout_s = confirm_timeout_s
        self.read_ahead = read_ahead
        self.remember = remember
        self.retry_max_s = retry_max_s
        self._arrived: deque[Delivered[Batch]] = deque()
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._seen: OrderedDict[str, asyncio.Future[Delivered[Batch] | None] | None] = OrderedDict()
        """Batch id -> for a batch run from the express list, its Kafka copy once it comes; else None."""
        self._tasks: list[asyncio.Task[None]] = []
        self._failure: TransportError | None = None

    async def start(self, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback) -> None:
        await self.express.start()
        try:
            await self.express.clear(self.worker_id)
        except TransportError as err:  # what it holds is run once anyway: copies are matched by batch id
            log.warning("worker %s: could not clear its express list: %s", self.worker_id, err)
        await self.kafka.start(on_assigned, on_revoked)
        self._tasks = [
            asyncio.create_task(self._read_kafka(), name=f"{self.worker_id}-kafka-reader"),
            asyncio.create_task(self._read_express(), name=f"{self.worker_id}-express-reader"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for copy in self._seen.values():
            if copy is not None and not copy.done():
                copy.set_result(None)
        self._arrived.clear()
        await self.kafka.close()
        await self.express.close()

    def assignment(self) -> frozenset[int]:
        return self.kafka.assignment()

    async def next(self, timeout_s: float) -> Delivered[Batch] | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if self._failure is not None:
                raise self._failure
            while self._arrived:
                delivered = self._arrived.popleft()
                self._room.set()
                if delivered.partition == EXPRESS or delivered.partition in self.kafka.assignment():
                    return delivered
                # read from a partition revoked since: its new owner reads it again
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            self._wake.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._wake.wait()
            except TimeoutError:
                return None

    async def commit(self, delivered: Delivered[Batch]) -> None:
        if delivered.partition != EXPRESS:
            await self.kafka.commit(delivered)
            return
        batch = delivered.value
        copy = None if batch is None else self._seen.get(batch.batch_id)
        if batch is None or copy is None:
            return
        try:
            async with asyncio.timeout(self.confirm_timeout_s):
                record = await asyncio.shield(copy)
        except TimeoutError:
            record = None
        if record is None:  # the next commit on that partition covers it
            log.info(
                "worker %s: no Kafka copy of express batch %s yet; not committing it",
                self.worker_id,
                batch.batch_id,
            )
            return
        await self.kafka.commit(record)

    # the readers -------------------------------------------------------------------------------
    def _queue(self, delivered: Delivered[Batch]) -> None:
        self._arrived.append(delivered)
        self._wake.set()
        if len(self._arrived) >= self.read_ahead:
            self._room.clear()

    def _remember(self, batch_id: str, copy: asyncio.Future[Delivered[Batch] | None] | None) -> None:
        self._seen[batch_id] = copy
        while len(self._seen) > self.remember:
            _, old = self._seen.popitem(last=False)
            if old is not None and not old.done():
                old.set_result(None)

    def _from_kafka(self, delivered: Delivered[Batch]) -> None:
        batch = delivered.value
        if batch is None:  # undecodable: the worker skips it and commits past it
            self._queue(delivered)
            return
        known = self._seen.get(batch.batch_id, _MISSING)
        if known is None or known is _MISSING:
            self._remember(batch.batch_id, None)
            self._queue(delivered)
        elif isinstance(known, asyncio.Future) and not known.done():
            known.set_result(delivered)  # the express copy ran (or runs): this is its record
        # else a late copy of an express batch: a later commit covers it

    def _from_express(self, data: bytes) -> None:
        try:
            batch = decode_batch(data)
        except CodecError as err:
            log.warning(
                "worker %s: dropped an undecodable express batch (%s); Kafka's copy follows", self.worker_id, err
            )
            return
        if batch.batch_id in self._seen:
            return  # its Kafka copy came first
        self._remember(batch.batch_id, asyncio.get_running_loop().create_future())
        self._queue(Delivered(batch, EXPRESS, EXPRESS))

    async def _read_kafka(self) -> None:
        failures = 0
        while True:
            await self._room.wait()
            try:
                delivered = await self.kafka.next(1.0)
            except TransportError as err:
                if not err.retriable:
                    self._failure = err
                    self._wake.set()
                    return
                failures += 1
                await pause(log, f"worker {self.worker_id}", "reading batches", err, failures, self.retry_max_s)
                continue
            failures = 0
            if delivered is not None:
                self._from_kafka(delivered)

    async def _read_express(self) -> None:
        failures = 0
        while True:
            try:
                data = await self.express.pop(self.worker_id, 1.0)
            except TransportError as err:  # never fatal: the Kafka copies keep coming
                failures += 1
                await pause(log, f"worker {self.worker_id}", "reading express batches", err, failures, self.retry_max_s)
                continue
            failures = 0
            if data is not None:
                self._from_express(data)


# requests: gateway -> batcher ------------------------------------------------------------------


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

    The copy is published, then Kafka takes the record. If Kafka refuses it, the gateway
    answers 503 and marks the task failed (``Gateway._abandon``), so a copy a worker started anyway
    ends as that failure rather than as an answer nobody asked for twice.
    """

    def __init__(self, kafka: KafkaRequestProducer, express: RedisExpress, *, max_rps: float = 200.0) -> None:
        self.kafka = kafka
        self.express = express
        self._load = LightLoad(max_rps)

    async def start(self) -> None:
        await self.express.start()
        await self.kafka.start()

    async def close(self) -> None:
        await self.kafka.close()
        await self.express.close()

    async def ready(self) -> bool:
        return await self.kafka.ready()

    async def send(self, request: InferenceRequest) -> None:
        data = encode_request(request)
        partition = self.kafka.partitioner.choose(request.model)
        if not self._load.arrived():
            await self.kafka.send_encoded(data, partition)
            return
        await self._publish(partition, data)  # first, as for batches (ExpressBatchProducer.send)
        await self.kafka.send_encoded(data, partition)

    async def _publish(self, partition: int, data: bytes) -> None:
        try:
            await self.express.publish(partition, data)
        except TransportError as err:  # the Kafka record still gets there
            log.debug("express copy of a request not published: %s", err)


class ExpressRequestConsumer:
    """``RequestConsumer``: the owned partitions' Kafka records, and the express copies published for them.

    A copy comes as ``Delivered(request, partition, EXPRESS)``, usually before its Kafka record; the
    batcher matches the two (``batcher.express.ExpressLedger``), so each request is batched once and
    its offset is committed only after its batch is on Kafka. Copies come over one PubSub connection
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
        self._wake = asyncio.Event()
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
            self._fetching.cancel()
            await asyncio.gather(self._fetching, return_exceptions=True)
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
            copy = asyncio.create_task(self._wake.wait())
            try:
                await asyncio.wait({self._fetching, copy}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                copy.cancel()
        records: list[Delivered[InferenceRequest]] = []
        if self._fetching is not None and self._fetching.done():
            fetched, self._fetching = self._fetching, None
            owned = self.kafka.assignment()  # a partition revoked since is read again by its new owner
            records.extend(record for record in fetched.result() if record.partition in owned)
        records.extend(self._copies)
        self._copies = []
        self._wake.clear()
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
        self._copies.append(Delivered(request, partition, EXPRESS))
        self._wake.set()

    async def _on_resubscribed(self, channels: frozenset[str]) -> None:
        return None  # copies published meanwhile are lost; their Kafka records are not

    def _on_failure(self, err: BaseException) -> None:
        log.warning("express request copies stopped (%r); Kafka alone carries the requests now", err)
