"""TaskState schema evolution: v2 adds ``owner``, v3 ``deadline_ms``; older records stay readable."""

from __future__ import annotations

import io
import json
from importlib import resources

import fastavro

from schemas.codec import MAGIC, Kind, decode_state, encode_state
from schemas.records import TaskState, TaskStatus


def _old_bytes(record: dict[str, object], version: int = 1) -> bytes:
    """A TaskState as an older writer encodes it: that version's header and schema."""
    schema = fastavro.parse_schema(
        json.loads((resources.files("schemas") / "avro" / f"result.v{version}.avsc").read_text())
    )
    buf = io.BytesIO()
    buf.write(bytes((MAGIC, int(Kind.TASK_STATE), version)))
    fastavro.schemaless_writer(buf, schema, record)
    return buf.getvalue()


def test_a_v1_record_is_read_by_the_v2_reader_with_no_owner() -> None:
    data = _old_bytes(
        {
            "task_id": "t1",
            "status": "completed",
            "model": "sim",
            "updated_at_ms": 2,
            "enqueued_at_ms": 1,
            "output": "olleh",
            "error_code": None,
            "error_message": None,
            "batch_id": "b1",
            "batch_size": 4,
            "worker_id": "w1",
            "reply_to": "gw-1",
        }
    )
    assert data[2] == 1, "the test must feed a v1 record"

    state = decode_state(data)

    assert state == TaskState(
        "t1", TaskStatus.COMPLETED, "sim", 2, 1, "olleh", None, None, "b1", 4, "w1", "gw-1", owner=None
    )


def test_a_v2_record_is_read_by_the_v3_reader_with_no_deadline() -> None:
    record = {"task_id": "t1", "status": "queued", "model": "sim", "updated_at_ms": 2, "enqueued_at_ms": 1}
    data = _old_bytes({**record, "owner": "0123456789abcdef"}, version=2)
    assert data[2] == 2, "the test must feed a v2 record"

    state = decode_state(data)

    assert state == TaskState("t1", TaskStatus.QUEUED, "sim", 2, 1, owner="0123456789abcdef", deadline_ms=None)


def test_the_current_writer_is_v3_and_keeps_the_owner_and_the_deadline() -> None:
    state = TaskState("t1", TaskStatus.QUEUED, "sim", 2, 1, owner="0123456789abcdef", deadline_ms=1_800_000_000_000)
    data = encode_state(state)
    assert data[:3] == bytes((MAGIC, int(Kind.TASK_STATE), 3)), f"header {data[:3]!r}"
    assert decode_state(data) == state
    assert "deadline_ms" not in state.to_public(), "the deadline is the service's, not shown to clients"


def test_owner_is_the_last_field_so_positional_construction_still_works() -> None:
    state = TaskState("t1", TaskStatus.QUEUED, "sim", 2, 1, None, None, None, None, None, None, "gw")
    assert (state.reply_to, state.owner) == ("gw", None)
    assert "owner" not in state.to_public(), "the owner is never shown to clients"
