"""The Avro contracts: round trips, schema evolution (old writer, new reader), and bad bytes."""

from __future__ import annotations

import io
import json
from pathlib import Path

import fastavro
import pytest

from schemas import codec
from schemas.codec import MAGIC, CodecError, Kind
from schemas.records import Batch, BatchItem, Credit, InferenceRequest, TaskState, TaskStatus

AVRO = Path(codec.__file__).parent / "avro"


def test_every_record_round_trips() -> None:
    request = InferenceRequest("t1", "sim", "héllo ✓", 1_700_000_000_000, 1_700_000_030_000, "gw-1", "owner")
    assert codec.decode_request(codec.encode_request(request)) == request
    batch = Batch("b1", "sim", "batcher-1", 1, "idle_worker", "w:3", (BatchItem.of(request), BatchItem.of(request)))
    assert codec.decode_batch(codec.encode_batch(batch)) == batch
    credit = Credit("w", "sim", 3, 7, 1, 2, max_batch=32, free_at_ms=3)
    assert codec.decode_credit(codec.encode_credit(credit)) == credit
    state = TaskState("t1", TaskStatus.FAILED, "sim", 5, 1, error_code="backend_error", error_message="boom")
    assert codec.decode_state(codec.encode_state(state)) == state


def test_header_names_kind_and_version() -> None:
    data = codec.encode_request(InferenceRequest("t", "m", "x", 1, 2))
    assert data[0] == MAGIC
    assert data[1] == Kind.REQUEST
    assert data[2] == max(int(p.name.split(".v")[1].split(".")[0]) for p in AVRO.glob("request.v*.avsc"))


def test_the_current_reader_reads_records_written_by_the_previous_version() -> None:
    v1 = fastavro.parse_schema(json.loads((AVRO / "request.v1.avsc").read_text()))
    buf = io.BytesIO()
    buf.write(bytes((MAGIC, Kind.REQUEST, 1)))
    fastavro.schemaless_writer(
        buf,
        v1,
        {"task_id": "old", "model": "sim", "input": "abc", "enqueued_at_ms": 1, "deadline_ms": 2, "reply_to": None},
    )
    decoded = codec.decode_request(buf.getvalue())
    assert decoded == InferenceRequest("old", "sim", "abc", 1, 2, None, owner=None), "new fields take their defaults"


def test_a_credit_from_a_v1_worker_frees_at_its_issue_time() -> None:
    v1 = fastavro.parse_schema(json.loads((AVRO / "credit.v1.avsc").read_text()))
    buf = io.BytesIO()
    buf.write(bytes((MAGIC, Kind.CREDIT, 1)))
    old = {"worker_id": "w", "model": "sim", "partition": 0, "seq": 1, "issued_at_ms": 5, "expires_at_ms": 9}
    fastavro.schemaless_writer(buf, v1, {**old, "max_batch": 0, "busy_ms": 0})
    decoded = codec.decode_credit(buf.getvalue())
    assert decoded == Credit("w", "sim", 0, 1, 5, 9)
    assert decoded.idle_from_ms == 5, "an old worker's credit is idle from when it was offered"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "bad magic"),
        (b"\x00\x01\x01", "bad magic"),
        (bytes((MAGIC, Kind.BATCH, 1)), "expected a REQUEST"),
        (bytes((MAGIC, Kind.REQUEST, 99)), "version 99 is unknown"),
        (bytes((MAGIC, Kind.REQUEST, 1)) + b"\x02", "corrupt REQUEST"),
        (bytes((MAGIC, Kind.REQUEST)), "truncated REQUEST record: 2 byte"),
        (bytes((MAGIC, Kind.REQUEST, 1)), "corrupt REQUEST record: it ends early"),
    ],
)
def test_bad_bytes_raise_codec_error(data: bytes, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        codec.decode_request(data)


def test_trailing_bytes_are_rejected() -> None:
    data = codec.encode_request(InferenceRequest("t", "m", "x", 1, 2)) + b"\x00"
    with pytest.raises(CodecError, match="trailing"):
        codec.decode_request(data)
