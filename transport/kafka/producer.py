"""An idempotent aiokafka producer that replaces itself when the broker refuses its record numbering.

Tuned for latency on a lightly loaded bus: it sends at once unless a caller asks it to linger
(``linger_ms``), and a send awaits the broker's ack.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition
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

from transport.errors import PermanentTransportError
from transport.kafka.group import translate
from transport.ports import TransportError

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

    async def send(self, topic: str, partition: int, value: bytes, headers: Headers | None = None) -> None:
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
                acked = await producer.send(topic, value, partition=partition, headers=headers)
            except ProducerClosed:
                continue  # retired by a send that renewed it: the fresh producer takes the record
            except KafkaError as err:
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
        now = time.monotonic()
        if now - self._refreshed_at >= METADATA_RETRY_S:
            self._refreshed_at = now
            producer.client.force_metadata_update()
        return False

    async def ready(self, topic: str) -> bool:
        """Metadata for ``topic`` is known and the leader of its first partition is connected."""
        producer = self.producer
        if producer is None:
            return False
        try:
            async with asyncio.timeout(self.ready_timeout_s):
                partitions = await producer.partitions_for(topic)
                tp = TopicPartition(topic, min(partitions))
                if not self._leader_known(producer, tp):
                    return False
                return bool(await producer.client.ready(producer.client.cluster.leader_for_partition(tp)))
        except (TimeoutError, KafkaError, ValueError):
            return False
