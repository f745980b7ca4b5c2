"""Kafka producers of the request topic, the batch topics and the dead-letter topic, and the
idempotent aiokafka producer each of them sends through.

Gateways send requests to batchers, batchers send batches to workers, workers send dead letters to
people. Each producer is a ``RenewingProducer`` pointed at its topic, which replaces itself when the
broker refuses its record numbering; records are Avro (``schemas.codec``). Tuned for latency on a
lightly loaded bus: a producer sends at once unless it is asked to linger (``linger_ms``), and a
send awaits the broker's ack. The request producer lingers only while requests come close together:
a lone request goes at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.client import ConnectionGroup
from aiokafka.errors import (
    InvalidProducerEpoch,
    KafkaError,
    KafkaTimeoutError,
    OutOfOrderSequenceNumber,
    ProducerClosed,
    ProducerFenced,
    UnknownProducerId,
    UnknownTopicOrPartitionError,
)
from aiokafka.protocol.metadata import MetadataRequest

from schemas.codec import encode_batch, encode_request
from schemas.deadletter import DeadLetter, encode_dead_letter
from schemas.records import Batch, InferenceRequest
from schemas.wire import TRACEPARENT_HEADER, Names
from transport import loop_time
from transport.breaker import CircuitBreaker
from transport.errors import PermanentTransportError
from transport.kafka.group import translate
from transport.ports import TransportError
from transport.routing import Partitioner

log = logging.getLogger(__name__)

Headers = list[tuple[str, bytes]]
"""Kafka record headers: (name, value) pairs."""

# A produce waits this long for the broker's ack. A gateway request has a deadline of seconds, so a
# broker that cannot answer in 5 s is better reported than waited on for aiokafka's default 40 s.
DEFAULT_REQUEST_TIMEOUT_MS = 5000
# While a partition has no known leader (the broker is down or moving it), a send fails at once and
# asks for fresh metadata at most this often. aiokafka's sender would otherwise retry a queued batch
# in a loop with no pause until its request timeout.
METADATA_RETRY_S = 0.25
# The broker refused a record because this producer's sequence numbers for the partition no longer
# follow the ones it holds (or it holds none, or the producer id is stale). aiokafka never resets a
# sequence, so every later record on that partition would be refused too: the producer is replaced
# and the record sent again by the fresh one.
SEQUENCE_ERRORS = (OutOfOrderSequenceNumber, UnknownProducerId, InvalidProducerEpoch, ProducerFenced)
# How many fresh producers one send may ask for before it reports the failure.
RENEWALS_PER_SEND = 3


class RenewingProducer:
    """An idempotent aiokafka producer that replaces itself after a gap in its record numbering.

    The request, batch and dead-letter producers each send through one.

    Every record waits for ``acks="all"``: on a replicated topic only that survives losing the
    leader (with ``min.insync.replicas`` it needs that many copies), and on one broker it costs the
    same as ``acks=1``. The producer is idempotent: the broker drops a record that aiokafka retries
    after its ack was lost (a leader that died between writing and answering), so a retry inside the
    client writes nothing twice.

    aiokafka numbers a partition's records when it first sends them and never renumbers: a record it
    gives up after that (its partition had no leader for ``request_timeout_ms``, or the broker
    refused it) leaves a gap, and the broker then refuses every later record on the partition with
    ``OutOfOrderSequenceNumber``. So a failed ack retires the producer and starts a fresh one (a new
    producer id, numbering from 0), and a record refused for its numbering is sent again by it. A
    record sent again, or sent again by the caller after a send timed out, may be written twice;
    that is harmless, because a request or a batch read twice ends its tasks once (task states only
    move forward, and a worker skips tasks that already ended).
    """

    def __init__(
        self,
        bootstrap: str,
        *,
        client_id: str,
        linger_ms: float,
        request_timeout_ms: int,
        compression_type: str | None,
        ready_timeout_s: float,
    ) -> None:
        self.bootstrap = bootstrap
        self.ready_timeout_s = ready_timeout_s
        # An idempotent producer retries a record until it is acked, without end: a send waits this
        # long, as a non-idempotent producer's record would live.
        self.ack_timeout_s = request_timeout_ms / 1000
        self._settings: dict[str, Any] = {
            "bootstrap_servers": bootstrap,
            "client_id": client_id,
            "acks": "all",
            "enable_idempotence": True,
            "linger_ms": linger_ms,
            "request_timeout_ms": request_timeout_ms,
            "compression_type": compression_type,
        }
        self.producer: Any = None
        self.renewals = 0
        self._refreshed_at = 0.0
        self._renewing = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if self.producer is not None:
            raise RuntimeError("producer started twice")
        self.producer = await self._started()

    async def _started(self) -> Any:
        producer = AIOKafkaProducer(**self._settings)
        try:
            await producer.start()
        except BaseException as err:
            await producer.stop()
            if isinstance(err, KafkaError):
                raise translate(f"connecting a producer to {self.bootstrap}", err) from err
            raise
        return producer

    async def close(self) -> None:
        """Flushes what is in flight (at most ``ack_timeout_s``), then disconnects."""
        producer, self.producer = self.producer, None
        if producer is not None:
            self._retire(producer)
        while self._retiring:
            await asyncio.gather(*self._retiring)

    def _retire(self, producer: Any) -> None:
        task = asyncio.create_task(self._stop(producer))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _stop(self, producer: Any) -> None:
        """Waits for the acks of what is in flight, gives up what is still unacked after ``ack_timeout_s``, stops."""
        try:
            async with asyncio.timeout(self.ack_timeout_s):
                await producer.flush()
        except TimeoutError:
            # aiokafka has no public way to give records up: an idempotent producer would retry
            # them, and its stop() wait for them, as long as their leader is unreachable.
            producer._message_accumulator.fail_all(KafkaTimeoutError("the producer closed before the broker acked"))
        await producer.stop()

    async def _renew(self, broken: Any, why: BaseException) -> None:
        """Replaces ``broken`` with a fresh producer, unless another send replaced it already.

        A fresh producer that cannot start (the bus is down) leaves ``broken`` in place: its next
        refused record asks again.
        """
        async with self._renewing:
            if self.producer is not broken:
                return
            try:
                async with asyncio.timeout(self.ack_timeout_s):
                    fresh = await self._started()
            except (TimeoutError, TransportError) as err:
                log.warning(
                    "could not replace the producer to %s after %s: %s", self.bootstrap, type(why).__name__, err
                )
                return
            self.producer = fresh
            self.renewals += 1
            log.warning("replaced the producer to %s after %s: %s", self.bootstrap, type(why).__name__, why)
            self._retire(broken)

    async def partitions(self, topic: str) -> set[int]:
        """The topic's partitions from metadata (cached; a round trip only the first time)."""
        if self.producer is None:
            raise PermanentTransportError("producer is not started (or closed)")
        try:
            found: set[int] = await self.producer.partitions_for(topic)
        except UnknownTopicOrPartitionError as err:
            raise PermanentTransportError(
                f"topic {topic} does not exist on {self.bootstrap} (broker auto-creation is off): create it "
                "before starting this service"
            ) from err
        except KafkaError as err:
            raise translate(f"reading metadata of {topic}", err) from err
        return found

    async def send(
        self, topic: str, partition: int, value: bytes, headers: Headers | None = None, *, at_once: bool = False
    ) -> None:
        """Returns once the broker acknowledged the record. ``at_once``: the record goes in a record batch
        of its own, closed, which aiokafka sends without waiting out ``linger_ms``."""
        partitions = await self.partitions(topic)
        if partition not in partitions:  # the topic may have grown (`topics grow`) since metadata was cached
            partitions = await self._refreshed_partitions(topic)
        if partition not in partitions:
            raise PermanentTransportError(
                f"partition {partition} does not exist in {topic}, which has {len(partitions)} partitions: "
                "create the topic with more partitions or route to fewer"
            )
        if not self._leader_known(self.producer, TopicPartition(topic, partition)):
            raise TransportError(
                f"producing to {topic}[{partition}] failed: no leader is known for it (is the broker at "
                f"{self.bootstrap} down?); try again"
            )
        refused: BaseException | None = None
        for _ in range(RENEWALS_PER_SEND + 1):
            producer = self.producer
            if producer is None:
                raise PermanentTransportError("producer is not started (or closed)")
            try:
                alone = producer.create_batch() if at_once else None
                if alone is not None and alone.append(timestamp=None, key=None, value=value, headers=headers or []):
                    alone.close()
                    acked = await self._queue_alone(producer, alone, topic, partition)
                else:  # lingers (a batch takes its first record whatever its size, so at_once ends above)
                    acked = await producer.send(topic, value, partition=partition, headers=headers)
            except ProducerClosed:
                continue  # retired by a send that renewed it: the fresh producer takes the record
            except KafkaError as err:
                if _sender_died(producer):  # it refuses every record from now on: a fresh one takes this one
                    refused = err
                    await self._renew(producer, err)
                    continue
                raise translate(f"producing to {topic}[{partition}]", err) from err
            try:
                async with asyncio.timeout(self.ack_timeout_s):
                    await acked
            except TimeoutError as err:
                raise TransportError(
                    f"producing to {topic}[{partition}] failed: no ack within {self.ack_timeout_s:g} s (a leader "
                    "is moving, or too few replicas are in sync); try again"
                ) from err
            except SEQUENCE_ERRORS as err:
                refused = err  # not written: the fresh producer sends it again
                await self._renew(producer, err)
                continue
            except KafkaError as err:
                if producer is not self.producer:
                    raise TransportError(
                        f"producing to {topic}[{partition}] failed: its producer was retired before the broker "
                        f"acked ({type(err).__name__}: {err}); try again"
                    ) from err
                await self._renew(producer, err)  # the record gave up numbers the broker never saw
                raise translate(f"producing to {topic}[{partition}]", err) from err
            return
        raise TransportError(
            f"producing to {topic}[{partition}] failed: the broker refused {RENEWALS_PER_SEND + 1} producers in a "
            f"row ({type(refused).__name__}: {refused}); try again"
        )

    async def _queue_alone(self, producer: Any, batch: Any, topic: str, partition: int) -> Any:
        """Queues a record batch of its own behind the partition's pending one; returns its ack future.

        aiokafka's ``send_batch`` waits for each pending batch to drain but counts every wait from its
        first (aiokafka 0.14), so a record queued behind a stall (a paused broker, a blocked event loop)
        gives up long before ``request_timeout_ms``, at a turn of the queue. Nothing was queued then,
        so the send asks again until ``ack_timeout_s`` has passed since its first ask.
        """
        try:
            async with asyncio.timeout(self.ack_timeout_s):
                while True:
                    try:
                        return await producer.send_batch(batch, topic, partition=partition)
                    except KafkaTimeoutError:
                        continue
        except TimeoutError as err:
            raise KafkaTimeoutError(f"no room on {topic}[{partition}] within {self.ack_timeout_s:g} s") from err

    async def _refreshed_partitions(self, topic: str) -> set[int]:
        try:
            await self.producer.client.force_metadata_update()
        except KafkaError as err:
            raise translate(f"reading metadata of {topic}", err) from err
        found: set[int] = self.producer.client.cluster.partitions_for_topic(topic) or set()
        return found

    def _leader_known(self, producer: Any, tp: TopicPartition) -> bool:
        """Whether the partition has a leader in the cached metadata; if not, a refresh is asked for."""
        leader = producer.client.cluster.leader_for_partition(tp)
        if leader is not None and leader >= 0:
            return True
        self._ask_for_metadata(producer)
        return False

    def _ask_for_metadata(self, producer: Any) -> None:
        """Has aiokafka refresh the cluster's metadata in the background, at most every ``METADATA_RETRY_S``."""
        now = time.monotonic()
        if now - self._refreshed_at >= METADATA_RETRY_S:
            self._refreshed_at = now
            producer.client.force_metadata_update()

    async def ready(self, topic: str) -> bool:
        """The leader of ``topic``'s first partition answers a metadata request within ``ready_timeout_s``
        of the time the event loop could run (``transport.loop_time``: an answer that came while the loop
        was blocked counts).

        A round trip, not the connection's state: a frozen or partitioned broker (a long pause, a
        network cut) keeps its connections open while it answers nothing."""
        producer = self.producer
        if producer is None:
            return False
        answered = False
        try:
            async with loop_time.timeout(self.ready_timeout_s):
                partitions = await producer.partitions_for(topic)
                tp = TopicPartition(topic, min(partitions))
                if not self._leader_known(producer, tp):
                    return False
                leader = producer.client.cluster.leader_for_partition(tp)
                # A connection of its own: the broker answers one request per connection at a time, and on
                # the sender's a probe would wait behind a produce request that is slow to be acknowledged.
                await producer.client.send(leader, MetadataRequest([topic]), group=ConnectionGroup.COORDINATION)
                answered = True
                return True
        except (TimeoutError, KafkaError, ValueError):
            return False
        finally:
            if not answered:
                # A leader that does not answer may lead no more: the cluster fences a frozen or cut-off
                # broker and elects another among the in-sync copies, which the cached metadata learns only
                # from a refresh. aiokafka refreshes after a produce error, and while the breaker is open
                # nothing is produced: without this, every probe would ask the silent broker for as long as
                # it stays silent. In ``finally``: the breaker's probe is cut short by its own bound of the
                # same length, which reaches this one as a cancellation.
                self._ask_for_metadata(producer)


# While the request producer's breaker is open, the bus is probed this often (a connection attempt).
BREAKER_RETRY_S = 0.5
IDLE_LINGERS = 5
"""A request this many lingers after the one before it goes at once (``KafkaRequestProducer``)."""


def trace_headers(traceparent: str | None) -> Headers | None:
    """The record's W3C trace context as a Kafka header, for tools that read the topics (batchwire's
    own consumers read it from the record's value); none while tracing is off."""
    return None if traceparent is None else [(TRACEPARENT_HEADER, traceparent.encode())]


class KafkaRequestProducer:
    """Gateway side of the request topic: each request goes to its model's partitions (``Partitioner``).

    ``send`` returns once the request is durably accepted (``acks="all"``: see ``RenewingProducer``); a
    duplicate record is harmless, because task states only move forward and a terminal state is
    written once.

    ``linger_ms`` gathers requests into one produce request: a round trip costs the gateway, the
    batcher and the broker CPU whatever it carries, and under load a request read a few ms later
    waits for a busy worker anyway. A request that comes ``IDLE_LINGERS`` lingers or more after the one
    before it goes at once: light load does not pay for the linger, where company would seldom come
    within it. Under load the gateway's requests come in clumps (its event loop takes them in turns),
    so a gap of one linger is not rare there, and a gap of several is.

    A circuit breaker (``breaker``) remembers that the bus is down: a send that failed, or a
    readiness probe whose leader did not answer, opens it; a send still unacked after
    ``ready_timeout_s`` has the bus probed at once, so a broker that is frozen (connected, answering
    nothing) opens it too. Until a background probe reaches the broker again ``reachable()`` is False
    and ``send`` fails at once, instead of every request waiting out the produce timeout. A send in
    flight when it opens still waits for its ack or its caller's deadline.
    """

    def __init__(
        self,
        bootstrap: str,
        names: Names,
        partitioner: Partitioner,
        *,
        linger_ms: float = 0,
        request_timeout_ms: int = DEFAULT_REQUEST_TIMEOUT_MS,
        compression_type: str | None = None,
        client_id: str = "batchwire-gateway",
        ready_timeout_s: float = 1.0,
    ) -> None:
        self.topic = names.request_topic
        self.partitioner = partitioner
        self._producer = RenewingProducer(
            bootstrap,
            client_id=client_id,
            linger_ms=linger_ms,
            request_timeout_ms=request_timeout_ms,
            compression_type=compression_type,
            ready_timeout_s=ready_timeout_s,
        )
        self._linger_s = linger_ms / 1000
        self._last_send = -math.inf
        # A send unacked after this long is a hint that the bus may be down (a probe tells).
        self._suspect_after_s = ready_timeout_s
        self.breaker = CircuitBreaker(
            f"the request bus at {bootstrap}",
            lambda: self._producer.ready(self.topic),
            retry_s=BREAKER_RETRY_S,
            probe_timeout_s=ready_timeout_s,
        )

    async def start(self) -> None:
        """Connects and checks that the topic has every partition the partitioner routes to."""
        await self._producer.start()
        try:
            partitions = await self._producer.partitions(self.topic)
            if len(partitions) < self.partitioner.partitions:
                raise PermanentTransportError(
                    f"{self.topic} has {len(partitions)} partitions but the partitioner routes to "
                    f"{self.partitioner.partitions}: add partitions to the topic or configure "
                    f"{len(partitions)} request partitions"
                )
        except BaseException:
            await self._producer.close()
            raise

    async def close(self) -> None:
        await self.breaker.close()
        await self._producer.close()

    def reachable(self) -> bool:
        """False while the breaker is open (the bus is known to be down); no I/O."""
        return not self.breaker.open

    async def send(self, request: InferenceRequest) -> None:
        """Returns once the broker acknowledged the record."""
        await self.send_encoded(encode_request(request), self.partitioner.choose(request.model), request.traceparent)

    async def send_encoded(self, data: bytes, partition: int, traceparent: str | None = None) -> None:
        """``send`` for a request encoded already, to a partition chosen already."""
        if self.breaker.open:
            raise TransportError(f"{self.breaker.name} is down ({self.breaker.reason}); nothing was sent")
        started = time.monotonic()
        at_once = self._linger_s > 0 and started - self._last_send >= IDLE_LINGERS * self._linger_s
        self._last_send = started
        # A send still unacked after this long has the bus probed at once: a frozen broker fails no
        # send before the produce timeout, and every submit until then would wait on it.
        slow = asyncio.get_running_loop().call_later(self._suspect_after_s, self.breaker.suspect)
        try:
            await self._producer.send(self.topic, partition, data, trace_headers(traceparent), at_once=at_once)
        except PermanentTransportError:
            raise  # a configuration fault, not an outage
        except TransportError as err:
            self.breaker.failed(f"a send failed: {err}", started_at=started)
            raise
        finally:
            slow.cancel()

    async def ready(self) -> bool:
        """The topic's leader answers (``RenewingProducer.ready``); the answer also moves the breaker."""
        if self._producer.producer is None:
            return False
        up = await self._producer.ready(self.topic)
        if up:
            self.breaker.succeeded()
        else:
            self.breaker.failed("a readiness probe found no answering leader")
        return up


class KafkaBatchProducer:
    """Batcher side of the batch topics: a batch goes to the partition its claimed credit names."""

    def __init__(
        self,
        bootstrap: str,
        names: Names,
        *,
        linger_ms: float = 0,
        request_timeout_ms: int = DEFAULT_REQUEST_TIMEOUT_MS,
        compression_type: str | None = None,
        client_id: str = "batchwire-batcher",
        ready_timeout_s: float = 1.0,
    ) -> None:
        self.names = names
        self._producer = RenewingProducer(
            bootstrap,
            client_id=client_id,
            linger_ms=linger_ms,
            request_timeout_ms=request_timeout_ms,
            compression_type=compression_type,
            ready_timeout_s=ready_timeout_s,
        )

    async def start(self) -> None:
        await self._producer.start()

    async def close(self) -> None:
        await self._producer.close()

    async def send(self, batch: Batch, partition: int) -> None:
        """Returns once the broker acknowledged the batch."""
        await self.send_encoded(batch.model, encode_batch(batch), partition, batch.traceparent)

    async def send_encoded(self, model: str, data: bytes, partition: int, traceparent: str | None = None) -> None:
        """``send`` for a batch encoded already."""
        await self._producer.send(self.names.batch_topic(model), partition, data, trace_headers(traceparent))

    async def ready(self, model: str) -> bool:
        return await self._producer.ready(self.names.batch_topic(model))


class KafkaDeadLetterProducer:
    """Worker side of the dead-letter topic: inputs that kept killing workers, with why and how often.

    One partition is enough (dead letters are rare and read by people); ``send`` returns once the
    broker acknowledged the letter, so the worker commits the batch only after it is kept.
    """

    def __init__(
        self,
        bootstrap: str,
        names: Names,
        *,
        request_timeout_ms: int = DEFAULT_REQUEST_TIMEOUT_MS,
        client_id: str = "batchwire-worker",
        ready_timeout_s: float = 1.0,
    ) -> None:
        self.topic = names.dead_letter_topic
        self.where = f"on the dead-letter topic {self.topic}"
        self._producer = RenewingProducer(
            bootstrap,
            client_id=client_id,
            linger_ms=0,
            request_timeout_ms=request_timeout_ms,
            compression_type=None,
            ready_timeout_s=ready_timeout_s,
        )

    async def start(self) -> None:
        await self._producer.start()

    async def close(self) -> None:
        await self._producer.close()

    async def send(self, letter: DeadLetter) -> None:
        await self._producer.send(self.topic, 0, encode_dead_letter(letter))


def _sender_died(producer: Any) -> bool:
    """Whether the aiokafka producer's sender task ended: aiokafka then fails every later send at once
    with the error that ended it, and never starts another (read from its private ``_sender``, which
    no public API shows)."""
    task = producer._sender.sender_task
    return task is not None and task.done()
