"""Random and mutated bytes into every Avro decoder: ``CodecError`` or a well-typed record, quickly.

Covers ``schemas.codec``'s four decoders and ``schemas.deadletter``'s. Inputs: random bytes,
random bodies behind every real header (so they reach fastavro, not just the magic-byte check),
valid encodings (current and older schema versions) mutated by flips, truncation, extension,
insertion, deletion and varints claiming huge lengths, and each kind's records fed to every other
kind's decoder. A decoder may answer only with ``CodecError`` or with a record whose fields have
their declared types; each call must end within the Hypothesis deadline, and a length prefix
claiming gigabytes must not make it allocate more than a little memory.
"""

from __future__ import annotations

import io
import json
import time
import tracemalloc
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import fields, is_dataclass
from datetime import timedelta
from importlib import resources
from typing import Any

import fastavro
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.codec import (
    HEADER_SIZE,
    MAGIC,
    CodecError,
    Kind,
    decode_batch,
    decode_credit,
    decode_request,
    decode_state,
    encode_batch,
    encode_credit,
    encode_request,
    encode_state,
)
from schemas.deadletter import DEAD_LETTER_KIND, DeadLetter, DeadLetterItem, decode_dead_letter, encode_dead_letter
from schemas.records import Batch, BatchItem, Credit, InferenceRequest, TaskState, TaskStatus
from tests.fuzz.avro_wire import varint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SETTINGS = settings(
    max_examples=1000,
    derandomize=True,  # the same inputs every run, no example database
    database=None,
    deadline=timedelta(seconds=1),  # a decode takes microseconds; a second is a hang
    suppress_health_check=[HealthCheck.too_slow],
)
MAX_DECODE_BYTES = 1 << 20
"""Most memory one decode may allocate, whatever lengths its input claims (inputs are < 2 KiB)."""


# wire helpers ---------------------------------------------------------------------------------------
HUGE = (2**31 - 1, 2**31, 2**32, 2**40, 2**53, 2**62, 2**63 - 1, -1, -(2**31), -(2**62), -(2**63))
"""Lengths, counts and indices far beyond any input: gigabytes, exabytes, and negatives."""


def _older_schema(name: str) -> tuple[int, Any] | None:
    """The oldest schema version of ``name`` when there is more than one: writers still on it."""
    folder = resources.files("schemas") / "avro"
    versions = sorted(
        int(entry.name[len(name) + 2 : -len(".avsc")])
        for entry in folder.iterdir()
        if entry.name.startswith(f"{name}.v") and entry.name.endswith(".avsc")
    )
    if len(versions) < 2:
        return None
    text = (folder / f"{name}.v{versions[0]}.avsc").read_text()
    return versions[0], fastavro.parse_schema(json.loads(text))


def _encode_old(kind: int, name: str, record: dict[str, Any]) -> bytes:
    """``record`` as a writer on the oldest schema version of ``name`` would encode it."""
    older = _older_schema(name)
    assert older is not None, f"{name} has one schema version only"
    version, schema = older
    buf = io.BytesIO()
    buf.write(bytes((MAGIC, kind, version)))
    known = {f["name"] for f in schema["fields"]}
    fastavro.schemaless_writer(buf, schema, {key: value for key, value in record.items() if key in known})
    return buf.getvalue()


# decoders and the records they must return ---------------------------------------------------------
DECODERS: dict[str, tuple[Callable[[bytes], Any], type]] = {
    "request": (decode_request, InferenceRequest),
    "batch": (decode_batch, Batch),
    "credit": (decode_credit, Credit),
    "state": (decode_state, TaskState),
    "dead_letter": (decode_dead_letter, DeadLetter),
}
KIND_BYTE = {
    "request": int(Kind.REQUEST),
    "batch": int(Kind.BATCH),
    "credit": int(Kind.CREDIT),
    "state": int(Kind.TASK_STATE),
    "dead_letter": DEAD_LETTER_KIND,
}
_HINTS = {
    cls: typing.get_type_hints(cls)
    for cls in (InferenceRequest, BatchItem, Batch, Credit, TaskState, DeadLetter, DeadLetterItem)
}


def _conforms(value: Any, hint: Any) -> bool:
    """Whether ``value`` has the type ``hint`` names (the subset of typing the records use)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is tuple:
        (item, _ellipsis) = typing.get_args(hint)
        return isinstance(value, tuple) and all(_conforms(element, item) for element in value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type) and is_dataclass(hint):
        return isinstance(value, hint) and _well_typed(value)
    return isinstance(value, hint)


def _well_typed(record: Any) -> bool:
    hints = _HINTS[type(record)]
    return all(_conforms(getattr(record, spec.name), hints[spec.name]) for spec in fields(record))


def decode_checked(name: str, data: bytes) -> Any:
    """Decodes ``data`` with ``name``'s decoder: a well-typed record, or None for ``CodecError``.

    Any other exception fails the test with the input that caused it.
    """
    decode, record_type = DECODERS[name]
    try:
        record = decode(data)
    except CodecError:
        return None
    except Exception as err:  # the bug this file hunts: re-raised with the input attached
        raise AssertionError(
            f"decode_{name} raised {type(err).__name__} (only CodecError is allowed) for {data!r}"
        ) from err
    assert isinstance(record, record_type), f"decode_{name} returned {record!r} for {data!r}"
    assert _well_typed(record), f"decode_{name} returned a record with mistyped fields: {record!r} for {data!r}"
    return record


# strategies ------------------------------------------------------------------------------------------
text = st.text(st.characters(exclude_categories=["Cs"]), max_size=16)  # what UTF-8 can carry
longs = st.integers(-(2**63), 2**63 - 1)
ints = st.integers(-(2**31), 2**31 - 1)
maybe_text = st.none() | text

requests = st.builds(InferenceRequest, text, text, text, longs, longs, maybe_text, maybe_text)
batch_items = st.builds(BatchItem, text, text, longs, longs, maybe_text)
batches = st.builds(Batch, text, text, text, longs, text, maybe_text, st.lists(batch_items, max_size=3).map(tuple))
credits = st.builds(Credit, text, text, ints, longs, longs, longs, ints)
states = st.builds(
    TaskState,
    text,
    st.sampled_from(TaskStatus),
    text,
    longs,
    longs,
    maybe_text,
    maybe_text,
    maybe_text,
    maybe_text,
    st.none() | ints,
    maybe_text,
    maybe_text,
    maybe_text,
)
dead_letter_items = st.builds(DeadLetterItem, text, text, longs, ints, maybe_text)
dead_letters = st.builds(
    DeadLetter, text, text, text, text, ints, text, longs, st.lists(dead_letter_items, max_size=3).map(tuple)
)

CURRENT: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], bytes]]] = {
    "request": (requests, encode_request),
    "batch": (batches, encode_batch),
    "credit": (credits, encode_credit),
    "state": (states, encode_state),
    "dead_letter": (dead_letters, encode_dead_letter),
}
VALID: dict[str, st.SearchStrategy[bytes]] = {
    "request": requests.map(encode_request)
    | requests.map(lambda r: _encode_old(KIND_BYTE["request"], "request", _fields(r))),
    "batch": batches.map(encode_batch),
    "credit": credits.map(encode_credit),
    "state": states.map(encode_state)
    | states.map(lambda s: _encode_old(KIND_BYTE["state"], "result", {**_fields(s), "status": s.status.value})),
    "dead_letter": dead_letters.map(encode_dead_letter),
}


def _fields(record: Any) -> dict[str, Any]:
    return {spec.name: getattr(record, spec.name) for spec in fields(record)}


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[bytes]) -> bytes:
    """A valid encoding with one to four edits; the header is spared in most draws."""
    data = bytearray(draw(valid))
    first = draw(st.sampled_from([3, 3, 3, 0]))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "truncate", "extend", "insert", "delete", "huge"]))
        at = draw(st.integers(min(first, len(data)), len(data)))
        if op == "flip" and at < len(data):
            data[at] ^= draw(st.integers(1, 255))
        elif op == "set" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif op == "truncate":
            del data[at:]
        elif op == "extend":
            data += draw(st.binary(min_size=1, max_size=64))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif op == "huge":  # a length, count or index that claims far more than there is
            end = at + draw(st.integers(0, 9))
            data[at:end] = varint(draw(st.sampled_from(HUGE)))
    return bytes(data)


HEADERS = [bytes((MAGIC, kind, version)) for kind in range(7) for version in range(4)]
framed = st.builds(lambda header, body: header + body, st.sampled_from(HEADERS), st.binary(max_size=300))


# property tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", DECODERS)
@SETTINGS
@given(data=st.binary(max_size=512))
def test_random_bytes(name: str, data: bytes) -> None:
    decode_checked(name, data)


@pytest.mark.parametrize("name", DECODERS)
@SETTINGS
@given(data=framed)
def test_random_body_behind_a_real_header(name: str, data: bytes) -> None:
    decode_checked(name, data)


@pytest.mark.parametrize("name", DECODERS)
@settings(SETTINGS, max_examples=1200)
@given(data=st.data())
def test_mutated_valid_encodings(name: str, data: st.DataObject) -> None:
    decode_checked(name, data.draw(mutated(VALID[name])))


@pytest.mark.parametrize("name", DECODERS)
@settings(SETTINGS, max_examples=300)
@given(data=st.data())
def test_valid_encodings_decode(name: str, data: st.DataObject) -> None:
    """The mutations start from real encodings, current and older versions: every one of them decodes."""
    encoded = data.draw(VALID[name])
    assert decode_checked(name, encoded) is not None, f"decode_{name} refused a valid encoding {encoded!r}"


@pytest.mark.parametrize("name", DECODERS)
@settings(SETTINGS, max_examples=300)
@given(data=st.data())
def test_current_records_round_trip(name: str, data: st.DataObject) -> None:
    strategy, encode = CURRENT[name]
    record = data.draw(strategy)
    assert decode_checked(name, encode(record)) == record


@pytest.mark.parametrize(("name", "other"), [(name, other) for name in DECODERS for other in DECODERS if name != other])
@settings(SETTINGS, max_examples=100)
@given(data=st.data())
def test_another_kinds_record_is_refused(name: str, other: str, data: st.DataObject) -> None:
    encoded = data.draw(VALID[other])
    with pytest.raises(CodecError):
        DECODERS[name][0](encoded)


@pytest.mark.parametrize("name", DECODERS)
@settings(SETTINGS, max_examples=200)
@given(data=st.data())
def test_another_kinds_body_under_this_kinds_header(name: str, data: st.DataObject) -> None:
    """A body read with the wrong schema (a kind byte flipped in transit): CodecError or a typed record."""
    other = data.draw(st.sampled_from(sorted(DECODERS)))
    encoded = data.draw(VALID[other])
    decode_checked(name, bytes((MAGIC, KIND_BYTE[name], encoded[2])) + encoded[3:])


# huge lengths: bounded memory and time, whatever the claim ------------------------------------------------
def _samples() -> Iterator[tuple[str, bytes]]:
    yield "request", encode_request(InferenceRequest("t" * 22, "sim", "hello", 1, 2, "gw-1", "owner"))
    yield (
        "batch",
        encode_batch(Batch("b", "sim", "bt", 1, "size", "w:1", (BatchItem("t", "in", 1, 2, "gw"),) * 3)),
    )
    yield "credit", encode_credit(Credit("w", "sim", 1, 2, 3, 4, 5))
    yield "state", encode_state(TaskState("t", TaskStatus.COMPLETED, "sim", 1, 1, "out", None, None, "b", 3, "w"))
    yield (
        "dead_letter",
        encode_dead_letter(DeadLetter("b", "sim", "bt", "w", 3, "died", 5, (DeadLetterItem("t", "in", 1, 3),) * 2)),
    )


def _claims() -> Iterator[tuple[str, bytes]]:
    """Every sample with a huge varint spliced in at every body offset, over 0 to 2 original bytes."""
    for name, encoded in _samples():
        for at in range(3, len(encoded) + 1):
            for replaced in range(3):
                for value in HUGE:
                    yield name, encoded[:at] + varint(value) + encoded[at + replaced :]


def test_huge_claimed_lengths_allocate_little_and_end_fast() -> None:
    worst_bytes, worst_s, count = 0, 0.0, 0
    tracemalloc.start()
    try:
        for name, data in _claims():
            tracemalloc.reset_peak()
            before, _ = tracemalloc.get_traced_memory()
            started = time.perf_counter()
            decode_checked(name, data)
            took_s = time.perf_counter() - started
            _, peak = tracemalloc.get_traced_memory()
            assert peak - before < MAX_DECODE_BYTES, (
                f"decode_{name} allocated {peak - before} bytes for a {len(data)}-byte input {data!r}"
            )
            assert took_s < 1.0, f"decode_{name} took {took_s:.2f} s for {data!r}"
            worst_bytes, worst_s, count = max(worst_bytes, peak - before), max(worst_s, took_s), count + 1
    finally:
        tracemalloc.stop()
    assert count > 5000, f"expected thousands of spliced inputs, made {count}"
    print(f"\n{count} huge-length inputs: at most {worst_bytes} bytes allocated, {worst_s * 1e3:.2f} ms per decode")


# gaps in fastavro's reader that the codec guards against (schemas/codec.py, read_canonical) ---------------------
def _replace_after(encoded: bytes, marker: bytes, old: bytes, new: bytes, *, before: bool = False) -> bytes:
    """``encoded`` with ``old`` (right after the string ``marker``, or right before its length) made ``new``."""
    at = encoded.index(marker)
    start = at - 1 - len(old) if before else at + len(marker)
    assert encoded[start : start + len(old)] == old, f"{old!r} is not where expected in {encoded!r}"
    return encoded[:start] + new + encoded[start + len(old) :]


SCHEMA_FILES = {"request": "request", "state": "result", "credit": "credit"}
READ_BY_FASTAVRO = {
    # A union branch index of -1 is read as Python's list[-1]: the last branch ("string") of reply_to.
    "union index -1": (
        "request",
        _replace_after(
            encode_request(InferenceRequest("t1", "sim", "hi", 1, 2, "reply-marker")),
            b"reply-marker",
            varint(1),
            varint(-1),
            before=True,
        ),
    ),
    # An enum index of -1 is read as list[-1]: a queued task's status becomes "cancelled".
    "enum index -1": (
        "state",
        _replace_after(
            encode_state(TaskState("task-marker", TaskStatus.QUEUED, "sim", 1, 1)),
            b"task-marker",
            varint(0),
            varint(-1),
        ),
    ),
    # Avro's int is 32 bits; fastavro reads any long into it: a credit for partition 2**40.
    "int beyond 32 bits": (
        "credit",
        _replace_after(
            encode_credit(Credit("w", "model-marker", 1234567, 2, 3, 4)),
            b"model-marker",
            varint(1234567),
            varint(2**40),
        ),
    ),
    # A varint with a needless continuation byte: 4 spelled as b"\\x88\\x00", not b"\\x08".
    "over-long number": (
        "credit",
        _replace_after(encode_credit(Credit("w", "model-marker", 4, 2, 3, 4)), b"model-marker", b"\x08", b"\x88\x00"),
    ),
}


@pytest.mark.parametrize("case", READ_BY_FASTAVRO)
def test_corrupt_indices_and_ints_are_refused(case: str) -> None:
    name, data = READ_BY_FASTAVRO[case]
    file = resources.files("schemas") / "avro" / f"{SCHEMA_FILES[name]}.v{data[2]}.avsc"
    schema = fastavro.parse_schema(json.loads(file.read_text()))
    read_by_fastavro = fastavro.schemaless_reader(io.BytesIO(data[HEADER_SIZE:]), schema, None)
    assert isinstance(read_by_fastavro, dict), read_by_fastavro
    record = decode_checked(name, data)
    assert record is None, f"decode_{name} accepted corrupt bytes {data!r} as {record!r}"
