"""The dead-letter record: inputs set aside because GPU workers kept dying while they were in flight.

Kept apart from ``records.py`` and ``codec.py`` (one concept per module); it uses the same
three-byte header (magic, record kind, schema version) as every other batchwire record, with a
kind of its own (``DEAD_LETTER_KIND``), so a reader can tell it from a batch or a request.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

import fastavro
from fastavro.types import Schema

from schemas import strict
from schemas.codec import HEADER_SIZE, MAGIC, CodecError

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


def _load() -> dict[int, Schema]:
    folder = resources.files("schemas") / "avro"
    versions: dict[int, Schema] = {}
    for entry in folder.iterdir():
        name = entry.name
        if name.startswith("deadletter.v") and name.endswith(".avsc"):
            version = int(name[len("deadletter.v") : -len(".avsc")])
            versions[version] = fastavro.parse_schema(json.loads(entry.read_text()))
    if not versions:
        raise RuntimeError(f"no Avro schema deadletter.v*.avsc in {folder}")
    return versions


_VERSIONS = _load()
_VERSION = max(_VERSIONS)
_SCHEMA = _VERSIONS[_VERSION]


def encode_dead_letter(letter: DeadLetter) -> bytes:
    record: dict[str, Any] = asdict(letter)
    buf = io.BytesIO()
    buf.write(bytes((MAGIC, DEAD_LETTER_KIND, _VERSION)))
    fastavro.schemaless_writer(buf, _SCHEMA, record)
    return buf.getvalue()


def decode_dead_letter(data: bytes) -> DeadLetter:
    if len(data) < HEADER_SIZE or data[0] != MAGIC:
        raise CodecError("not a batchwire record (bad magic byte)")
    if data[1] != DEAD_LETTER_KIND:
        raise CodecError(f"expected a dead-letter record (kind {DEAD_LETTER_KIND}), got kind {data[1]}")
    writer = _VERSIONS.get(data[2])
    if writer is None:
        raise CodecError(
            f"dead-letter schema version {data[2]} is unknown to this reader (knows {sorted(_VERSIONS)}); "
            "upgrade this process"
        )
    try:
        record = strict.read(data, HEADER_SIZE, writer, _SCHEMA)
    except Exception as err:  # fastavro raises assorted types on truncated or corrupt input
        raise CodecError(f"corrupt dead-letter record: {err}") from err
    items = tuple(DeadLetterItem(**item) for item in record.pop("items"))
    return DeadLetter(items=items, **record)
