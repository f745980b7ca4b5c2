"""Avro (fastavro, schemaless) encoding with a three-byte header: magic, record kind, schema version.

The header lets a reader of the current version decode records written by any older version it
knows, so producers and consumers can be upgraded one at a time.
"""

from __future__ import annotations

import io
import json
from dataclasses import fields
from enum import IntEnum
from importlib import resources
from typing import Any

import fastavro
from fastavro.types import Schema

from schemas import strict
from schemas.records import Batch, BatchItem, Credit, InferenceRequest, Priority, TaskState, TaskStatus

MAGIC = 0xB7
HEADER_SIZE = 3


class CodecError(ValueError):
    """Bytes that are not a batchwire record this version can read."""


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
        if len(data) < HEADER_SIZE or data[0] != MAGIC:
            raise CodecError("not a batchwire record (bad magic byte)")
        if data[1] != self.kind:
            raise CodecError(f"expected a {self.label} record (kind {self.kind}), got kind {data[1]}")
        writer = self.versions.get(data[2])
        if writer is None:
            raise CodecError(
                f"{self.label} schema version {data[2]} is unknown to this reader (knows {sorted(self.versions)}); "
                "upgrade this process"
            )
        try:
            return strict.read(data, HEADER_SIZE, writer, self.schema)
        except Exception as err:  # fastavro raises assorted types on truncated or corrupt input
            raise CodecError(f"corrupt {self.label} record: {err}") from err


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
