"""Request v3 and batch v2 add the W3C trace context; records written before it stay readable."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import fastavro

from schemas import codec
from schemas.codec import MAGIC, Kind
from schemas.records import Batch, BatchItem, InferenceRequest

AVRO = Path(codec.__file__).parent / "avro"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _written_by(name: str, kind: Kind, version: int, record: dict[str, Any]) -> bytes:
    schema = fastavro.parse_schema(json.loads((AVRO / name).read_text()))
    buf = io.BytesIO()
    buf.write(bytes((MAGIC, kind, version)))
    fastavro.schemaless_writer(buf, schema, record)
    return buf.getvalue()


def test_a_request_from_a_v2_gateway_has_no_trace_context() -> None:
    old = {"task_id": "t", "model": "sim", "input": "x", "enqueued_at_ms": 1, "deadline_ms": 2}
    data = _written_by("request.v2.avsc", Kind.REQUEST, 2, {**old, "reply_to": "gw", "owner": None})
    assert codec.decode_request(data) == InferenceRequest("t", "sim", "x", 1, 2, "gw", None, traceparent=None)


def test_a_batch_from_a_v1_batcher_has_no_trace_contexts() -> None:
    item = {"task_id": "t", "input": "x", "enqueued_at_ms": 1, "deadline_ms": 2, "reply_to": None}
    old = {"batch_id": "b", "model": "sim", "batcher_id": "bt", "created_at_ms": 3, "flush_reason": "size"}
    data = _written_by("batch.v1.avsc", Kind.BATCH, 1, {**old, "credit": None, "items": [item]})
    batch = codec.decode_batch(data)
    assert batch.traceparent is None
    assert batch.items == (BatchItem("t", "x", 1, 2, None, traceparent=None),)


def test_trace_contexts_round_trip_and_follow_the_request_into_its_batch() -> None:
    request = InferenceRequest("t", "sim", "x", 1, 2, "gw", traceparent=TRACEPARENT)
    assert codec.decode_request(codec.encode_request(request)).traceparent == TRACEPARENT
    item = BatchItem.of(request)
    assert item.traceparent == TRACEPARENT
    batch = Batch("b", "sim", "bt", 3, "size", "w:1", (item,), traceparent=TRACEPARENT.replace("b7ad", "c7ad"))
    assert codec.decode_batch(codec.encode_batch(batch)) == batch
