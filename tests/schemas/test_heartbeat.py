"""A heartbeat on the wire: JSON that round-trips, that a reader never fails on, and that says when a member is gone."""

from __future__ import annotations

import json

from schemas.heartbeat import FORGET_AFTER_S, GONE_AFTER_BEATS, Beat, decode_beat

BEAT = Beat(
    role="worker",
    id="sim-worker-0",
    host="h1",
    pid=42,
    version="0.1.0",
    models=("sim",),
    state="busy",
    at_ms=1_700_000_000_000,
    interval_s=1.0,
    figures={"batches_per_s": 9.87654, "busy_fraction": 0.5},
    breakdowns={"flushes_per_s": {"full": 1.0}},
    per_model={"sim": {"queue_depth": 3.0}},
)


def test_a_beat_round_trips_with_its_figures_to_three_decimals() -> None:
    decoded = decode_beat(BEAT.encode())
    assert decoded is not None
    assert decoded.figures == {"batches_per_s": 9.877, "busy_fraction": 0.5}
    assert (decoded.role, decoded.id, decoded.models, decoded.state, decoded.at_ms) == (
        "worker",
        "sim-worker-0",
        ("sim",),
        "busy",
        1_700_000_000_000,
    )
    assert decoded.breakdowns == BEAT.breakdowns and decoded.per_model == BEAT.per_model


def test_a_reader_skips_what_is_no_beat_and_reads_fields_it_does_not_know() -> None:
    assert decode_beat(b"{not json") is None
    assert decode_beat(b'{"role": "worker"}') is None
    assert decode_beat(b'{"role": "worker", "id": 1, "host": "h", "pid": "x"}') is None
    later = json.loads(BEAT.encode())
    later["gpu_memory_bytes"] = 12  # a field a later release adds
    assert decode_beat(json.dumps(later)) is not None


def test_a_reader_skips_a_beat_whose_numbers_or_nesting_python_cannot_hold() -> None:
    """JSON's ``Infinity`` (or ``1e400``) as an integer, and nesting past the recursion limit, raise
    other errors than ``ValueError``: one such entry in the fleet hash must be skipped, not fail the read."""
    doc = BEAT.encode().decode()
    for field in ("pid", "at_ms"):
        for number in ("Infinity", "1e400"):
            raw = doc.replace(f'"{field}":{json.loads(doc)[field]}', f'"{field}":{number}', 1)
            assert raw != doc, f"{field} not found in {doc}"
            assert decode_beat(raw) is None, f"{field}={number} should read as no beat"
    assert decode_beat("[" * 100_000) is None


def test_a_member_is_live_until_it_missed_its_beats_then_gone_then_forgotten() -> None:
    last = BEAT.at_ms
    assert BEAT.live(last + GONE_AFTER_BEATS * 1000)
    assert not BEAT.live(last + GONE_AFTER_BEATS * 1000 + 1)
    assert BEAT.to_public(last + 10_000)["state"] == "gone"
    assert BEAT.to_public(last + 500)["state"] == "busy"
    assert not BEAT.forgotten(last + int(FORGET_AFTER_S * 1000))
    assert BEAT.forgotten(last + int(FORGET_AFTER_S * 1000) + 1)


def test_a_stated_ttl_that_is_no_usable_number_reads_as_none_and_keeps_the_beat() -> None:
    """The TTL is an optional field: a value no role could have (text, a bool, zero, an integer past a
    float's range) is not judged, and the beat is still read (dropped, it left the fleet for every reader)."""
    for value in ("3600", True, 0, -5, 10**400):
        doc = json.loads(BEAT.encode())
        doc["result_ttl_s"] = value
        decoded = decode_beat(json.dumps(doc))
        assert decoded is not None and decoded.result_ttl_s is None, (value, decoded)
    doc["result_ttl_s"] = 3600
    decoded = decode_beat(json.dumps(doc))
    assert decoded is not None and decoded.result_ttl_s == 3600.0
