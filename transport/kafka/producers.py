"""Kafka producers of the request topic, the batch topics and the dead-letter topic.

Gateways send requests to batchers, batchers send batches to workers, workers send dead letters to
people. Each producer is a ``RenewingProducer`` pointed at its topic; records are Avro (``schemas.codec``).
"""

from __future__ import annotations

import asyncio
import time

from schemas.codec import encode_batch, encode_request
from schemas.deadletter import DeadLetter, encode_dead_letter
from schemas.records import Batch, InferenceRequest
from schemas.wire import TRACEPARENT_HEADER, Names
from transport.breaker import CircuitBreaker
from transport.errors import PermanentTransportError
from transport.kafka.producer import DEFAULT_REQUEST_TIMEOUT_MS, Headers, RenewingProducer
from transport.ports import TransportError
from transport.routing import Partitioner

# While the request producer's breaker is open, the bus is probed this often (a connection attempt).
BREAKER_RETRY_S = 0.5


def trace_headers(traceparent: str | None) -> Headers | None:
    """The record's W3C trace context as a Kafka header, for tools that read the topics (batchwire's
    own consumers read it from the record's value); none while tracing is off."""
    return None if traceparent is None else [(TRACEPARENT_HEADER, traceparent.encode())]


class KafkaRequestProducer:
    """Gateway side of the request topic: each request goes to its model's partitions (``Partitioner``).

    ``send`` returns once the request is durably accepted (``acks="all"``: see ``RenewingProducer``); a
    duplicate record is harmless, because task states only move forward and a terminal state is
    written once.

    A circuit breaker (``breaker``) remembers that the bus is down: a send that failed or a
    readiness probe that found no connected leader opens it, and until a background probe reaches
    the broker again ``reachable()`` is False and ``send`` fails at once, instead of every request
    waiting out the produce timeout.
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
        # A send cancelled (its caller's deadline) after this long is a hint that the bus may be down.
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
        try:
            await self._producer.send(self.topic, partition, data, trace_headers(traceparent))
        except PermanentTransportError:
            raise  # a configuration fault, not an outage
        except TransportError as err:
            self.breaker.failed(f"a send failed: {err}")
            raise
        except asyncio.CancelledError:
            if time.monotonic() - started >= self._suspect_after_s:
                self.breaker.suspect()
            raise

    async def ready(self) -> bool:
        """The topic's metadata is known and its leader connected; the answer also moves the breaker."""
        if self._producer.producer is None:
            return False
        up = await self._producer.ready(self.topic)
        if up:
            self.breaker.succeeded()
        else:
            self.breaker.failed("a readiness probe found no connected leader")
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
