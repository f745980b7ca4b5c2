"""The operators' reader of the dead-letter topic (``batchwire dead-letters``).

A module of its own so that no role imports it: the roles consume the request and batch topics
(``transport.kafka.consumers``), never this one.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from infra.topics import BOOTSTRAP_WAIT, admin_client
from schemas.deadletter import DeadLetter, decode_dead_letter
from schemas.wire import Names
from transport.errors import PermanentTransportError
from transport.kafka.consumers import RecordDecoder
from transport.kafka.group import translate
from transport.ports import Delivered, TransportError


class NoDeadLetterTopic(PermanentTransportError):
    """The namespace has no dead-letter topic on this cluster: none of its workers has started over Kafka there."""


STALL_S = 30.0
"""How long a read to the ends waits with no record coming before it fails: the consumer retries a broker that
went away for ever, and the command would print nothing and never end."""


class KafkaDeadLetterReader:
    """Operators' side of the dead-letter topic: every partition from its beginning, in no consumer group and
    committing nothing, so that reading it moves no offset and no group a role uses."""

    def __init__(
        self, bootstrap: str, names: Names, *, client_id: str = "batchwire-dead-letters", stall_s: float = STALL_S
    ) -> None:
        self.topic = names.dead_letter_topic
        self.stall_s = stall_s
        self._bootstrap = bootstrap
        self._client_id = client_id
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            client_id=client_id,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",  # letters that retention removed while being read: on from the oldest kept
        )
        self._decode = RecordDecoder(self.topic, decode_dead_letter, every=1)
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
        admin = admin_client(self._bootstrap, self._client_id)
        try:
            await admin.start()
            # Listed first: a broker that auto-creates topics creates one that a metadata request names.
            if self.topic not in await admin.list_topics():
                raise NoDeadLetterTopic(f"there is no topic {self.topic} at {self._bootstrap}")
            (described,) = await admin.describe_topics([self.topic])
        except KafkaError as err:
            raise translate(f"looking up {self.topic} at {self._bootstrap} ({BOOTSTRAP_WAIT})", err) from err
        finally:
            await admin.close()
        return [TopicPartition(self.topic, p["partition"]) for p in described["partitions"]]

    async def close(self) -> None:
        await self._consumer.stop()

    async def letters(self, *, follow: bool) -> AsyncGenerator[Delivered[DeadLetter]]:
        """Each record in offset order within its partition (``value`` None, and a warning logged, for one that
        does not decode); up to the ends found by ``start``, or for as long as it is read when ``follow``."""
        left = {tp for tp, end in self._ends.items() if end > 0}
        came_at = time.monotonic()
        while follow or left:
            try:
                fetched = await self._consumer.getmany(timeout_ms=1000)
                left -= {tp for tp in left if await self._consumer.position(tp) >= self._ends[tp]}
            except KafkaError as err:
                raise translate(f"reading {self.topic} at {self._bootstrap}", err) from err
            if fetched:
                came_at = time.monotonic()
            elif left and not follow and time.monotonic() - came_at > self.stall_s:
                raise TransportError(
                    f"reading {self.topic} at {self._bootstrap}: no record came for {self.stall_s:g} s, with "
                    f"{len(left)} partition(s) not read to their end"
                )
            for records in fetched.values():
                for record in records:
                    yield self._decode(record)
