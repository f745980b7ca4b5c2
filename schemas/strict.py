"""Avro reads that refuse what fastavro's reader lets through.

fastavro reads a negative union or enum index as Python's ``list[-1]`` (the last branch or symbol:
a queued task read as cancelled) and any long into an ``int`` field. :func:`read` accepts a record
only when its bytes are exactly what encoding it again gives (the canonical encoding, which has no
negative index and no over-long varint) and its ``int`` values fit in 32 bits. Encoding again costs
less than the read itself; fastavro has no strict mode to do it for us.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from typing import Any

import fastavro
from fastavro.types import Schema

INT_MIN, INT_MAX = -(2**31), 2**31 - 1

Check = Callable[[Any], bool]
"""Whether a decoded value's ``int`` parts fit in 32 bits."""


class NotCanonical(ValueError):
    """Bytes that decode, but not to a record whose encoding they are."""


def read(data: bytes, offset: int, writer: Schema, reader: Schema | None) -> dict[str, Any]:
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
