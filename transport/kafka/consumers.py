"""Kafka consumers of the request topic (batchers) and the batch topics (workers).

Consumers long-poll, and the broker answers a parked fetch as soon as a record lands. Records are
Avro (``schemas.codec``); bytes that do not decode are handed on as ``Delivered(None, ...)`` so the
service can commit past them instead of stalling the partition.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from schemas.codec import CodecError, decode_batch, decode_request
from schemas.records import Batch, InferenceRequest
from schemas.wire import Names
from transport.kafka.group import GroupConsumer, GroupTiming
from transport.ports import Delivered, PartitionsCallback

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMING = GroupTiming()


class RecordDecoder(Generic[T]):
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
        self._decode = RecordDecoder(names.request_topic, decode_request)

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
        self._decode = RecordDecoder(topic, decode_batch)
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
