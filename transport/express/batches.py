"""Batches both ways (batcher -> worker): the Kafka record and an express copy to the claiming worker's list.

See ``transport.express.copies`` for why and what stays true.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass

from schemas.codec import CodecError, decode_batch, encode_batch
from schemas.records import Batch, Credit
from telemetry.logs import ids
from transport.cancelling import cancel_and_wait
from transport.express.copies import POPPERS, RedisExpress
from transport.kafka.producers import KafkaBatchProducer
from transport.ports import (
    UNKNOWN,
    BatchConsumer,
    Delivered,
    PartitionsCallback,
    TransportError,
)
from transport.retry import pause, retry

log = logging.getLogger(__name__)


class ExpressBatchProducer:
    """``BatchProducer``: the Kafka copy, and an express copy to the worker the batch's credit names.

    A batch for an idle worker has its Kafka record produced ``record_delay_s`` after its copy: that
    worker starts the call the moment the copy arrives, and on a small machine the brokers' work for
    the record (the leader's append, the followers' fetches, the worker's own fetch) would take CPU
    from that start; delayed, it happens while the GPU computes. A batch for a busy worker waits for
    it anyway, so its record goes at once.
    """

    def __init__(
        self, kafka: KafkaBatchProducer, express: RedisExpress, *, record_delay_s: float = 0.0, retry_max_s: float = 2.0
    ) -> None:
        self.kafka = kafka
        self.express = express
        self.record_delay_s = record_delay_s
        self.retry_max_s = retry_max_s

    async def start(self) -> None:
        await self.express.start()
        await self.kafka.start()

    async def close(self) -> None:
        await self.kafka.close()
        await self.express.close()

    async def send(self, batch: Batch, partition: int, *, idle_worker: bool = False) -> None:
        if batch.credit is None:
            await self.kafka.send(batch, partition)
            return
        worker = Credit.worker_of(batch.credit)
        data = encode_batch(batch)
        # The copy first, then the record: on a small machine the broker's work for the record would
        # otherwise compete for the CPU with the copy's hop and the worker's start.
        pushed = await self._push(worker, data, batch)
        if pushed and idle_worker and self.record_delay_s > 0:
            await asyncio.sleep(self.record_delay_s)
        try:
            await self.kafka.send_encoded(batch.model, data, partition, batch.traceparent)  # encoded once, for both
        except TransportError as err:
            if not pushed or await self._retract(worker, data):
                raise
            log.warning(
                "Kafka refused batch %s (%s); its worker runs it already, so sending it again",
                batch.batch_id,
                err,
                extra=ids(batch_id=batch.batch_id, traceparent=batch.traceparent),
            )
            await retry(
                log,
                "express",
                f"sending batch {batch.batch_id} to Kafka",
                lambda: self.kafka.send_encoded(batch.model, data, partition, batch.traceparent),
                self.retry_max_s,
            )

    async def _push(self, worker: str, data: bytes, batch: Batch) -> bool:
        try:
            return await self.express.push(worker, data, batch.batch_id, [item.task_id for item in batch.items])
        except TransportError as err:  # Kafka's copy still gets there
            log.debug("express copy to %s not sent: %s", worker, err)
            return False

    async def _retract(self, worker: str, data: bytes) -> bool:
        try:
            return await self.express.retract(worker, data)
        except TransportError as err:
            log.warning("could not take an express batch back from %s: %s", worker, err)
            return False  # it may have been taken: the safe side is to land it on Kafka


_MISSING = object()


@dataclass(slots=True)
class _Awaited:
    """An express batch's Kafka copy, awaited until ``due``: its arrival plus the confirm timeout, so
    that copies late together (a broker's failover) cost their commits that long once, not each."""

    record: asyncio.Future[Delivered[Batch] | None]
    due: float

    def give_up(self) -> None:
        """Stops waiting for the record (the commit skips the batch); a record already come stays."""
        if not self.record.done():
            self.record.set_result(None)


class ExpressBatchConsumer:
    """``BatchConsumer``: a worker's batches from its Kafka partitions and its express list, each once.

    Owned tasks read the two sources into one queue. A batch id seen before is not queued again,
    except a Kafka record read anew after a rebalance (a redelivery, as without express).

    Two readers pop the express list, each on a connection of its own, and a reader that got a batch
    pops again only once the worker asks (``next``): the worker's loop sends nothing between a
    batch's arrival and its call's start (a command sent there holds up the backend's thread, which
    needs the GIL to start), while the other reader's BLPOP stays armed, so an express copy does not
    wait for a pop, nor its Kafka record (which counts as a second delivery) come first for want of one.
    A reader that gets a batch while the other already waits for an ask pops again at once, so one
    stays armed even when two batches come between two asks.
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
        self._asked = asyncio.Event()
        """The worker asked for a batch (``next``) since a reader's latest one."""
        self._popping = 0
        """Readers whose pop is armed: a reader that got a batch waits for an ask only if another is."""
        self._seen: OrderedDict[str, _Awaited | None] = OrderedDict()
        """Batch id -> for a batch run from the express list, its Kafka copy once it comes; else None."""
        self._tasks: list[asyncio.Task[None]] = []
        self._failure: TransportError | None = None

    async def start(self, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback) -> None:
        await self.express.start()
        try:
            await self.express.clear(self.worker_id)
        except TransportError as err:  # what it holds is run once anyway: copies are matched by batch id
            log.warning("worker %s: could not clear its express list: %s", self.worker_id, err)

        async def revoked(partitions: frozenset[int]) -> None:
            self._release()  # their records may go to the partitions' next owners
            await on_revoked(partitions)

        await self.kafka.start(on_assigned, revoked)
        self._tasks = [
            asyncio.create_task(self._read_kafka(), name=f"{self.worker_id}-kafka-reader"),
            *(
                asyncio.create_task(self._read_express(), name=f"{self.worker_id}-express-reader-{i}")
                for i in range(POPPERS)
            ),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            await cancel_and_wait(task)
        self._tasks.clear()
        self._release()
        self._arrived.clear()
        await self.kafka.close()
        await self.express.close()

    def assignment(self) -> frozenset[int]:
        return self.kafka.assignment()

    @property
    def queued(self) -> int:
        """Batches read from either source that ``next`` has not handed on yet."""
        return len(self._arrived)

    async def next(self, timeout_s: float) -> Delivered[Batch] | None:
        self._asked.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if self._failure is not None:
                raise self._failure
            while self._arrived:
                delivered = self._arrived.popleft()
                self._room.set()
                if delivered.via == "express" or delivered.partition in self.kafka.assignment():
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
        if delivered.via == "kafka":
            await self.kafka.commit(delivered)
            return
        batch = delivered.value
        copy = None if batch is None else self._seen.get(batch.batch_id)
        if batch is None or copy is None:
            return
        try:
            async with asyncio.timeout(max(0.0, copy.due - asyncio.get_running_loop().time())):
                record = await asyncio.shield(copy.record)
        except TimeoutError:
            record = None
        if record is None:  # the next commit on that partition covers it
            log.info(
                "worker %s: no Kafka copy of express batch %s yet; not committing it",
                self.worker_id,
                batch.batch_id,
                extra=ids(batch_id=batch.batch_id, traceparent=batch.traceparent),
            )
            return
        await self.kafka.commit(record)

    # the readers -------------------------------------------------------------------------------
    def _queue(self, delivered: Delivered[Batch]) -> None:
        self._arrived.append(delivered)
        self._wake.set()
        if len(self._arrived) >= self.read_ahead:
            self._room.clear()

    def _remember(self, batch_id: str, copy: _Awaited | None) -> None:
        self._seen[batch_id] = copy
        while len(self._seen) > self.remember:
            _, old = self._seen.popitem(last=False)
            if old is not None:
                old.give_up()

    def _release(self) -> None:
        """Stops waiting for every Kafka copy not come yet (the commits skip those batches)."""
        for copy in self._seen.values():
            if copy is not None:
                copy.give_up()

    def _from_kafka(self, delivered: Delivered[Batch]) -> None:
        batch = delivered.value
        if batch is None:  # undecodable: the worker skips it and commits past it
            self._queue(delivered)
            return
        known = self._seen.get(batch.batch_id, _MISSING)
        if known is None or known is _MISSING:
            self._remember(batch.batch_id, None)
            self._queue(delivered)
        elif isinstance(known, _Awaited) and not known.record.done():
            known.record.set_result(delivered)  # the express copy ran (or runs): this is its record
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
        loop = asyncio.get_running_loop()
        self._remember(batch.batch_id, _Awaited(loop.create_future(), loop.time() + self.confirm_timeout_s))
        self._queue(Delivered(batch, UNKNOWN, UNKNOWN, via="express"))

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
                data = await self._pop()
            except TransportError as err:  # never fatal: the Kafka copies keep coming
                failures += 1
                await pause(log, f"worker {self.worker_id}", "reading express batches", err, failures, self.retry_max_s)
                continue
            failures = 0
            if data is not None:
                self._from_express(data)
                if not self._popping:
                    continue  # the other reader waits for an ask already: this one stays armed
                self._asked.clear()
                await self._asked.wait()  # the other reader's BLPOP is armed meanwhile

    async def _pop(self) -> bytes | None:
        self._popping += 1
        try:
            return await self.express.pop(self.worker_id, 1.0)
        finally:
            self._popping -= 1
