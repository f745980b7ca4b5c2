"""The dead-letter record: inputs set aside because GPU workers kept dying while they were in flight.

Kept apart from ``records.py`` and ``codec.py`` (one concept per module); it uses the same
three-byte header (magic, record kind, schema version) as every other batchwire record, with a
kind of its own (``DEAD_LETTER_KIND``), so a reader can tell it from a batch or a request.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from schemas.codec import RecordCodec

DEAD_LETTER_KIND = 5
"""Record kind byte of dead letters; ``schemas.codec.Kind`` uses 1-4."""

DEAD_LETTERED = "dead_lettered"
"""The error code of a task whose input was dead-lettered."""


@dataclass(frozen=True, slots=True)
class DeadLetterItem:
    task_id: str
    input: str
    enqueued_at_ms: int
    strikes: int
    """Worker deaths while this input was in flight."""
    reply_to: str | None = None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    batch_id: str
    model: str
    batcher_id: str
    worker_id: str
    deliveries: int
    error: str
    dead_lettered_at_ms: int
    items: tuple[DeadLetterItem, ...] = field(default_factory=tuple)


_CODEC = RecordCodec(DEAD_LETTER_KIND, "deadletter", "dead-letter")


def encode_dead_letter(letter: DeadLetter) -> bytes:
    return _CODEC.encode_dict(asdict(letter))


def decode_dead_letter(data: bytes) -> DeadLetter:
    record = _CODEC.decode_dict(data)
    items = tuple(DeadLetterItem(**item) for item in record.pop("items"))
    return DeadLetter(items=items, **record)
