"""Avro (fastavro, schemaless) encoding with a three-byte header: magic, record kind, schema version.

The header lets a reader of the current version decode records written by any older version it
knows, and refuse a newer one by name: a release that raises a kind's version upgrades that kind's
readers before its writers (docs/operations.md, "Upgrading").

Reads are strict. fastavro reads a negative union or enum index as Python's ``list[-1]`` (the last
branch or symbol: a queued task read as cancelled) and any long into an ``int`` field.
:func:`read_canonical` accepts a record only when its bytes are exactly what encoding it again gives
(the canonical encoding, which has no negative index and no over-long varint) and its ``int`` values
fit in 32 bits. Encoding again costs about what the read costs; fastavro has no strict mode to do it
for us.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Mapping
from dataclasses import fields
from enum import IntEnum
from importlib import resources
from typing import Any

import fastavro
from fastavro.types import Schema

from schemas.records import Batch, BatchItem, Credit, InferenceRequest, Priority, TaskState, TaskStatus

MAGIC = 0xB7
HEADER_SIZE = 3


class CodecError(ValueError):
    """Bytes that are not a batchwire record this version can read."""


INT_MIN, INT_MAX = -(2**31), 2**31 - 1

Check = Callable[[Any], bool]
"""Whether a decoded value's ``int`` parts fit in 32 bits."""


class NotCanonical(ValueError):
    """Bytes that decode, but not to a record whose encoding they are."""


def read_canonical(data: bytes, offset: int, writer: Schema, reader: Schema | None) -> dict[str, Any]:
    """The record in ``data[offset:]``, written with ``writer`` and read as ``reader`` (None: as
    written). Raises fastavro's own errors for bytes it cannot read, and :class:`NotCanonical`."""
    buf = io.BytesIO(data)
    buf.seek(offset)
    record = fastavro.schemaless_reader(buf, writer, None)
    if not isinstance(record, dict):
        raise NotCanonical("not a record")
    if buf.tell() != len(data):
        raise NotCanonical(f"{len(data) - buf.tell()} trailing bytes")
    again = io.BytesIO()
    fastavro.schemaless_writer(again, writer, record)
    if again.getvalue() != memoryview(data)[offset:]:
        raise NotCanonical("not the canonical encoding of what it decodes to (a negative index or an over-long number)")
    if not _check_of(writer)(record):
        raise NotCanonical("an int beyond 32 bits")
    if reader is None or reader is writer:
        return record
    resolved = fastavro.schemaless_reader(io.BytesIO(data[offset:]), writer, reader)
    if not isinstance(resolved, dict):
        raise NotCanonical("not a record")
    return resolved


_CHECKS: dict[int, tuple[Schema, Check]] = {}
"""Each parsed schema's check, by identity; the schema is kept so that its id is never reused."""


def _check_of(schema: Schema) -> Check:
    entry = _CHECKS.get(id(schema))
    if entry is None:
        entry = _CHECKS[id(schema)] = (schema, _plan(schema, {}) or _always)
    return entry[1]


def _always(value: Any) -> bool:
    return True


def _plan(schema: Any, named: dict[str, Any]) -> Check | None:
    """A check of ``schema``'s ``int`` parts, or None where it has none. A check passes a value of
    another shape: in a union, the value belongs to one branch only."""
    if isinstance(schema, str):
        if schema == "int":
            return _int_fits
        return _plan(named[schema], named) if schema in named else None  # none of ours is recursive
    if isinstance(schema, list):
        wide = "long" in schema  # an int value may be the long branch's
        plans = (_plan(branch, named) for branch in schema if not (wide and branch == "int"))
        branches = [check for check in plans if check is not None]
        return (lambda value: all(check(value) for check in branches)) if branches else None
    if not isinstance(schema, Mapping):
        return None
    kind = schema.get("type")
    if kind == "record":
        named[schema["name"]] = schema
        fields = [(f["name"], c) for f in schema["fields"] if (c := _plan(f["type"], named)) is not None]
        if not fields:
            return None
        return lambda value: not isinstance(value, dict) or all(c(value.get(name)) for name, c in fields)
    if kind == "array":
        items = _plan(schema["items"], named)
        return (lambda value: not isinstance(value, list) or all(items(item) for item in value)) if items else None
    if kind == "map":
        values = _plan(schema["values"], named)
        if values is None:
            return None
        return lambda value: not isinstance(value, dict) or all(values(v) for v in value.values())
    return _plan(kind, named) if isinstance(kind, str | list) else None


def _int_fits(value: Any) -> bool:
    """True for a value outside the ``int`` branch of a union (``None``, a string) too."""
    return not isinstance(value, int) or isinstance(value, bool) or INT_MIN <= value <= INT_MAX


class Kind(IntEnum):
    REQUEST = 1
    BATCH = 2
    CREDIT = 3
    TASK_STATE = 4


def _load(stem: str) -> dict[int, Schema]:
    """Every known version of one record kind (``<stem>.v<N>.avsc``), parsed."""
    folder = resources.files("schemas") / "avro"
    prefix = stem + ".v"
    versions: dict[int, Schema] = {}
    for entry in folder.iterdir():
        name = entry.name
        if name.startswith(prefix) and name.endswith(".avsc"):
            version = int(name[len(prefix) : -len(".avsc")])
            versions[version] = fastavro.parse_schema(json.loads(entry.read_text()))
    if not versions:
        raise RuntimeError(f"no Avro schema {prefix}*.avsc in {folder}")
    return versions


class RecordCodec:
    """One record kind's header and schemas: writes the newest version, reads every known one."""

    def __init__(self, kind: int, stem: str, label: str) -> None:
        """``kind``: the header's kind byte; ``stem``: its schema files' names; ``label``: its name in errors."""
        self.kind = kind
        self.label = label
        self.versions = _load(stem)
        self.version = max(self.versions)
        self.schema = self.versions[self.version]
        self._header = bytes((MAGIC, kind, self.version))

    def encode_dict(self, record: dict[str, Any]) -> bytes:
        buf = io.BytesIO()
        buf.write(self._header)
        fastavro.schemaless_writer(buf, self.schema, record)
        return buf.getvalue()

    def decode_dict(self, data: bytes) -> dict[str, Any]:
        if not data or data[0] != MAGIC:
            raise CodecError("not a batchwire record (bad magic byte)")
        if len(data) < HEADER_SIZE:
            raise CodecError(
                f"truncated {self.label} record: {len(data)} byte(s), shorter than its {HEADER_SIZE}-byte header"
            )
        if data[1] != self.kind:
            raise CodecError(f"expected a {self.label} record (kind {self.kind}), got kind {data[1]}")
        writer = self.versions.get(data[2])
        if writer is None:
            raise CodecError(
                f"{self.label} schema version {data[2]} is unknown to this reader (knows {sorted(self.versions)}); "
                "upgrade this process"
            )
        try:
            return read_canonical(data, HEADER_SIZE, writer, self.schema)
        except Exception as err:  # fastavro raises assorted types on truncated or corrupt input
            reason = str(err) or ("it ends early" if isinstance(err, EOFError) else type(err).__name__)
            raise CodecError(f"corrupt {self.label} record: {reason}") from err


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _as_record(obj: Any) -> dict[str, Any]:
    """A dataclass as a dict, shallow: ``dataclasses.asdict`` deep-copies, a cost on every record."""
    names = _FIELD_NAMES.get(type(obj))
    if names is None:
        names = _FIELD_NAMES[type(obj)] = tuple(f.name for f in fields(obj))
    return {name: getattr(obj, name) for name in names}


_request = RecordCodec(Kind.REQUEST, "request", Kind.REQUEST.name)
_batch = RecordCodec(Kind.BATCH, "batch", Kind.BATCH.name)
_credit = RecordCodec(Kind.CREDIT, "credit", Kind.CREDIT.name)
_state = RecordCodec(Kind.TASK_STATE, "result", Kind.TASK_STATE.name)


def encode_request(request: InferenceRequest) -> bytes:
    return _request.encode_dict(_as_record(request))


def decode_request(data: bytes) -> InferenceRequest:
    record = _request.decode_dict(data)
    record["priority"] = Priority.of(record.get("priority"))
    return InferenceRequest(**record)


MAX_RECORD_BYTES = 1_048_576
"""The longest record Kafka takes as batchwire runs it: the producer's ``max_request_size`` and about the
broker's ``message.max.bytes``, both at their defaults."""
ITEM_FIXED_BYTES = 64
"""What a batch item's encoding takes besides its strings' UTF-8 bytes, at most: a length before each
string, its two times, its priority and its optional fields' markers."""
BATCH_FIXED_BYTES = 4096
"""What a batch's record takes besides its items, at most: the header, the batch's own fields (ids,
the credit, the trace context) and the bus's framing and trace headers."""

MAX_INPUT_BYTES = MAX_RECORD_BYTES - BATCH_FIXED_BYTES - ITEM_FIXED_BYTES - 1024
"""The longest input (UTF-8 bytes) a batch of its own carries, room left for its item's ids and trace
context: the gateway refuses a longer one, which only a ``--max-input-chars`` raised past it lets through."""


def item_bytes(request: InferenceRequest) -> int:
    """The most bytes ``request`` takes as an item of an encoded batch (``encode_batch``)."""
    strings = (request.task_id, request.input, request.reply_to or "", request.traceparent or "")
    return ITEM_FIXED_BYTES + sum(
        len(text) if text.isascii() else len(text.encode(errors="surrogatepass")) for text in strings
    )


def encode_batch(batch: Batch) -> bytes:
    record = {
        "batch_id": batch.batch_id,
        "model": batch.model,
        "batcher_id": batch.batcher_id,
        "created_at_ms": batch.created_at_ms,
        "flush_reason": batch.flush_reason,
        "credit": batch.credit,
        "traceparent": batch.traceparent,
        "items": [_as_record(item) for item in batch.items],
    }
    return _batch.encode_dict(record)


def decode_batch(data: bytes) -> Batch:
    record = _batch.decode_dict(data)
    items = tuple(BatchItem(**{**item, "priority": Priority.of(item.get("priority"))}) for item in record.pop("items"))
    return Batch(items=items, **record)


def encode_credit(credit: Credit) -> bytes:
    return _credit.encode_dict(_as_record(credit))


def decode_credit(data: bytes) -> Credit:
    return Credit(**_credit.decode_dict(data))


def encode_state(state: TaskState) -> bytes:
    record = _as_record(state)
    record["status"] = state.status.value
    return _state.encode_dict(record)


def decode_state(data: bytes) -> TaskState:
    record = _state.decode_dict(data)
    try:
        record["status"] = TaskStatus(record["status"])
    except ValueError as err:
        raise CodecError(f"unknown task status {record['status']!r}") from err
    return TaskState(**record)
