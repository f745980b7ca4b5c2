"""Kafka consumers of the request topic (batchers) and the batch topics (workers), and the reader of the
dead-letter topic (operators).

Consumers long-poll, and the broker answers a parked fetch as soon as a record lands. Records are
Avro (``schemas.codec``); bytes that do not decode are handed on as ``Delivered(None, ...)`` so the
service can commit past them instead of stalling the partition.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from schemas.codec import CodecError, decode_batch, decode_request
from schemas.deadletter import DeadLetter, decode_dead_letter
from schemas.records import Batch, InferenceRequest
from schemas.wire import Names
from transport.errors import PermanentTransportError
from transport.kafka.group import GroupConsumer, GroupTiming, translate
from transport.ports import Delivered, PartitionsCallback

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMING = GroupTiming()


class _Decoder(Generic[T]):
    """Decodes record values, turning undecodable bytes into ``None`` and warning once per ``every``."""

    def __init__(self, topic: str, decode: Callable[[bytes], T], every: int = 100) -> None:
        self.topic = topic
        self.decode = decode
        self.every = every
        self.undecodable = 0

    def __call__(self, record: Any) -> Delivered[T]:
        try:
            if record.value is None:
                raise CodecError("record has no value (tombstone)")
            value: T | None = self.decode(record.value)
        except CodecError as err:
            value = None
            self.undecodable += 1
            if self.undecodable % self.every == 1 or self.every == 1:
                log.warning(
                    "%d undecodable record(s) on %s so far; latest at partition %d offset %d: %s",
                    self.undecodable,
                    self.topic,
                    record.partition,
                    record.offset,
                    err,
                )
        return Delivered(value, record.partition, record.offset)


class KafkaRequestConsumer:
    """Batcher side of the request topic: group-managed partitions, offsets committed by the batcher.

    ``on_revoked`` is awaited while this member still owns the partitions (during a rebalance and
    on ``close``), so the batcher can commit what it already handed to workers.
    """

    def __init__(
        self,
        bootstrap: str,
        names: Names,
        *,
        group_id: str | None = None,
        timing: GroupTiming = DEFAULT_TIMING,
        max_poll_records: int = 500,
        client_id: str = "batchwire-batcher",
    ) -> None:
        self._group = GroupConsumer(
            bootstrap,
            names.request_topic,
            group_id if group_id is not None else names.batcher_group,
            client_id=client_id,
            max_poll_records=max_poll_records,
            timing=timing,
        )
        self._decode = _Decoder(names.request_topic, decode_request)

    @property
    def undecodable(self) -> int:
        """Records skipped as undecodable since start (for metrics)."""
        return self._decode.undecodable

    async def start(self, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback) -> None:
        await self._group.start(on_assigned, on_revoked)

    async def close(self) -> None:
        await self._group.close()

    async def fetch(self, timeout_s: float, max_records: int) -> Sequence[Delivered[InferenceRequest]]:
        records = await self._group.getmany(timeout_s, max_records)
        return [self._decode(record) for record in records]

    async def commit(self, offsets: Mapping[int, int]) -> None:
        await self._group.commit(offsets)

    def assignment(self) -> frozenset[int]:
        return self._group.assigned


class KafkaBatchConsumer:
    """Worker side of one model's batch topic, one batch at a time.

    Records fetched beyond the one returned wait in a local buffer, dropped when their partition
    is revoked (the new owner reads them again from the committed offset).
    """

    def __init__(
        self,
        bootstrap: str,
        names: Names,
        model: str,
        *,
        group_id: str | None = None,
        timing: GroupTiming = DEFAULT_TIMING,
        max_poll_records: int = 4,
        client_id: str = "batchwire-worker",
    ) -> None:
        topic = names.batch_topic(model)
        self._group = GroupConsumer(
            bootstrap,
            topic,
            group_id if group_id is not None else names.worker_group(model),
            client_id=client_id,
            max_poll_records=max_poll_records,
            timing=timing,
        )
        self._max_poll_records = max_poll_records
        self._decode = _Decoder(topic, decode_batch)
        self._buffer: deque[Delivered[Batch]] = deque()
        self._group.on_forget(self._drop)

    def _drop(self, partitions: frozenset[int]) -> None:
        self._buffer = deque(item for item in self._buffer if item.partition not in partitions)

    @property
    def undecodable(self) -> int:
        return self._decode.undecodable

    async def start(self, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback) -> None:
        await self._group.start(on_assigned, on_revoked)

    async def close(self) -> None:
        await self._group.close()
        self._buffer.clear()

    async def next(self, timeout_s: float) -> Delivered[Batch] | None:
        if not self._buffer:
            for record in await self._group.getmany(timeout_s, self._max_poll_records):
                self._buffer.append(self._decode(record))
        return self._buffer.popleft() if self._buffer else None

    async def commit(self, delivered: Delivered[Batch]) -> None:
        """Commits past ``delivered``: its partition resumes after it on the next assignment."""
        await self._group.commit({delivered.partition: delivered.offset + 1})

    def assignment(self) -> frozenset[int]:
        return self._group.assigned


class NoDeadLetterTopic(PermanentTransportError):
    """The namespace has no dead-letter topic on this cluster: none of its workers has started over Kafka there."""


class KafkaDeadLetterReader:
    """Operators' side of the dead-letter topic: every partition from its beginning, in no consumer group and
    committing nothing, so that reading it moves no offset and no group a role uses."""

    def __init__(self, bootstrap: str, names: Names, *, client_id: str = "batchwire-dead-letters") -> None:
        self.topic = names.dead_letter_topic
        self._bootstrap = bootstrap
        self._client_id = client_id
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            client_id=client_id,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",  # letters that retention removed while being read: on from the oldest kept
        )
        self._decode = _Decoder(self.topic, decode_dead_letter, every=1)
        self._ends: dict[TopicPartition, int] = {}

    @property
    def undecodable(self) -> int:
        return self._decode.undecodable

    async def start(self) -> None:
        """Takes every partition from its beginning and notes where each ends now (``NoDeadLetterTopic``
        when the topic is not there)."""
        partitions = await self._partitions()
        try:
            await self._consumer.start()
            self._consumer.assign(partitions)
            await self._consumer.seek_to_beginning(*partitions)
            self._ends = await self._consumer.end_offsets(partitions)
        except KafkaError as err:
            raise translate(f"reading {self.topic} at {self._bootstrap}", err) from err

    async def _partitions(self) -> list[TopicPartition]:
        admin = AIOKafkaAdminClient(bootstrap_servers=self._bootstrap, client_id=self._client_id)
        try:
            await admin.start()
            # Listed first: a broker that auto-creates topics creates one that a metadata request names.
            if self.topic not in await admin.list_topics():
                raise NoDeadLetterTopic(f"there is no topic {self.topic} at {self._bootstrap}")
            (described,) = await admin.describe_topics([self.topic])
        except KafkaError as err:
            raise translate(f"looking up {self.topic} at {self._bootstrap}", err) from err
        finally:
            await admin.close()
        return [TopicPartition(self.topic, p["partition"]) for p in described["partitions"]]

    async def close(self) -> None:
        await self._consumer.stop()

    async def letters(self, *, follow: bool) -> AsyncGenerator[Delivered[DeadLetter]]:
        """Each record in offset order within its partition (``value`` None, and a warning logged, for one that
        does not decode); up to the ends found by ``start``, or for as long as it is read when ``follow``."""
        left = {tp for tp, end in self._ends.items() if end > 0}
        while follow or left:
            try:
                fetched = await self._consumer.getmany(timeout_ms=1000)
                left -= {tp for tp in left if await self._consumer.position(tp) >= self._ends[tp]}
            except KafkaError as err:
                raise translate(f"reading {self.topic} at {self._bootstrap}", err) from err
            for records in fetched.values():
                for record in records:
                    yield self._decode(record)
