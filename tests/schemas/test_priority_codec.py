"""The request's priority tier on the wire: round trips, old records, and names a newer writer may add."""

from __future__ import annotations

import io
import json
from pathlib import Path

import fastavro
import pytest

from schemas import codec
from schemas.codec import MAGIC, Kind
from schemas.records import Batch, BatchItem, InferenceRequest, Priority

AVRO = Path(codec.__file__).parent / "avro"


def _written_by(version: int, record: dict[str, object]) -> bytes:
    schema = fastavro.parse_schema(json.loads((AVRO / f"request.v{version}.avsc").read_text()))
    buf = io.BytesIO()
    buf.write(bytes((MAGIC, Kind.REQUEST, version)))
    fastavro.schemaless_writer(buf, schema, record)
    return buf.getvalue()


@pytest.mark.parametrize("tier", list(Priority))
def test_each_tier_round_trips_as_its_enum(tier: Priority) -> None:
    request = InferenceRequest("t1", "sim", "x", 1, 2, "gw", "owner", priority=tier)
    decoded = codec.decode_request(codec.encode_request(request))
    assert decoded == request
    assert type(decoded.priority) is Priority, f"decoded priority is {type(decoded.priority)!r}, not Priority"


def test_a_v2_record_without_a_priority_reads_as_normal() -> None:
    old = {"task_id": "old", "model": "sim", "input": "abc", "enqueued_at_ms": 1, "deadline_ms": 2}
    decoded = codec.decode_request(_written_by(2, {**old, "reply_to": None, "owner": "o"}))
    assert decoded == InferenceRequest("old", "sim", "abc", 1, 2, None, "o", Priority.NORMAL)


def test_a_tier_name_this_reader_does_not_know_reads_as_normal() -> None:
    record = {"task_id": "t", "model": "sim", "input": "abc", "enqueued_at_ms": 1, "deadline_ms": 2}
    decoded = codec.decode_request(_written_by(3, {**record, "reply_to": None, "owner": None, "priority": "urgent"}))
    assert decoded.priority is Priority.NORMAL


def test_ranks_put_high_first() -> None:
    assert [t.rank for t in (Priority.HIGH, Priority.NORMAL, Priority.LOW)] == [0, 1, 2]


def test_a_batch_item_carries_its_requests_tier() -> None:
    request = InferenceRequest("t1", "sim", "x", 1, 2, "gw", priority=Priority.HIGH)
    batch = Batch("b1", "sim", "batcher-1", 1, "full", "w:1", (BatchItem.of(request),))
    decoded = codec.decode_batch(codec.encode_batch(batch))
    assert decoded == batch
    assert type(decoded.items[0].priority) is Priority


def test_a_v1_batch_reads_its_items_as_normal() -> None:
    schema = fastavro.parse_schema(json.loads((AVRO / "batch.v1.avsc").read_text()))
    buf = io.BytesIO()
    buf.write(bytes((MAGIC, Kind.BATCH, 1)))
    item = {"task_id": "t", "input": "x", "enqueued_at_ms": 1, "deadline_ms": 2, "reply_to": None}
    record = {"batch_id": "b", "model": "sim", "batcher_id": "c", "created_at_ms": 1, "flush_reason": "full"}
    fastavro.schemaless_writer(buf, schema, {**record, "credit": None, "items": [item]})
    decoded = codec.decode_batch(buf.getvalue())
    assert decoded.items == (BatchItem("t", "x", 1, 2, None, Priority.NORMAL),)
