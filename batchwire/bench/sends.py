"""The record of a rate's sends: when each measured request was due, and how late it went.

The generator's own stalls (a descheduled process, a busy loop) hold requests back and then send
them in a burst, and each of them counts its lag in its latency. Replaying the record, the
simulation meets the same bursts a measured run met, where an ideal Poisson stream would have none
(``batchwire validate-sim``). It is stored in ``results.json`` in a compact form: zlib-compressed,
base64-encoded little-endian int32 microseconds, first each send's due time as a step from the one
before (from the window's start: a warm-up's sends are due before it, at negative times), then
each send's lag.
"""

from __future__ import annotations

import base64
import sys
import zlib
from array import array
from collections.abc import Sequence

ENCODING = "zlib-compressed, base64-encoded little-endian int32"


class SendsError(ValueError):
    """A send record cannot be decoded."""


def encode(sends: Sequence[tuple[float, float]]) -> str:
    """``(due_s, lag_s)`` pairs, due in ascending order (seconds from the window's start)."""
    steps, lags = array("i"), array("i")
    before = 0
    for due_s, lag_s in sends:
        due_us = round(due_s * 1e6)
        steps.append(due_us - before)
        lags.append(max(0, round(lag_s * 1e6)))
        before = due_us
    return pack(steps + lags)


def pack(numbers: array[int]) -> str:
    """int32 numbers as zlib-compressed, base64-encoded little-endian bytes (also ``batchwire.bench.calls``)."""
    data = array("i", numbers)
    if sys.byteorder != "little":
        data.byteswap()
    return base64.b64encode(zlib.compress(data.tobytes(), 9)).decode()


def unpack(text: str, what: str) -> array[int]:
    """The numbers ``pack`` was given; raises ``SendsError`` naming ``what`` when ``text`` is not its form."""
    data = array("i")
    try:
        data.frombytes(zlib.decompress(base64.b64decode(text, validate=True)))
    except (ValueError, zlib.error) as err:
        raise SendsError(f"the {what} is not {ENCODING}: {err}") from err
    if sys.byteorder != "little":
        data.byteswap()
    return data


def decode(text: str) -> list[tuple[float, float]]:
    """The ``(due_s, lag_s)`` pairs ``encode`` was given (to the microsecond)."""
    data = unpack(text, "send record")
    if len(data) % 2:
        raise SendsError(f"the send record holds {len(data)} numbers, not pairs")
    half = len(data) // 2
    pairs, due_us = [], 0
    for step, lag in zip(data[:half], data[half:], strict=True):
        due_us += step
        pairs.append((due_us / 1e6, lag / 1e6))
    return pairs
