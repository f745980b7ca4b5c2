"""The record of a rate's backend calls: when each started, its batch size and how long it ran.

A backend that computes on the machine's CPU runs longer under load than when profiled alone, and by
how much varies from call to call with what else wants the cores. The simulation gives its calls
the measured calls' extra times one by one, in the order the run made them
(``batchwire.capacity.extras``): a stall of the machine lengthens the calls of a second or two
together, which neither a mean nor independent draws reproduce. The bench reads the calls from the
workers' batch journal (``--batch-log``, whose times are the system's monotonic clock, the same in
every process), and stores them in ``results.json`` the way it stores the sends
(``batchwire.bench.sends``): each call's start as a step from the one before (from the window's
start), then every call's size, then its duration, in microseconds.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from batchwire.bench.sends import SendsError, pack, unpack


class Call(NamedTuple):
    at_s: float
    """When it started, from the window's start."""
    size: int
    seconds: float


def read(journal: Path, start_s: float, end_s: float) -> list[Call]:
    """Every first delivery's successful call that started in ``[start_s, end_s)`` (monotonic
    seconds), its start counted from ``start_s``, in the order they started; none when the journal is
    missing."""
    try:
        lines = journal.read_text().splitlines()
    except FileNotFoundError:
        return []
    calls = []
    for line in lines:
        try:
            call = json.loads(line)
        except ValueError:  # a line cut short while a worker was writing it
            continue
        began = float(call["start"])
        if call.get("outcome") == "ok" and call.get("delivery", 1) == 1 and start_s <= began < end_s:
            calls.append(Call(began - start_s, int(call["size"]), float(call["end"]) - began))
    return sorted(calls)


def encode(calls: Sequence[Call]) -> str:
    """Calls in the order they started, compact."""
    steps, before = array("i"), 0
    for call in calls:
        at_us = round(call.at_s * 1e6)
        steps.append(at_us - before)
        before = at_us
    sizes = array("i", (call.size for call in calls))
    return pack(steps + sizes + array("i", (round(call.seconds * 1e6) for call in calls)))


def decode(text: str) -> list[Call]:
    """The calls ``encode`` was given (to the microsecond)."""
    data = unpack(text, "call record")
    if len(data) % 3:
        raise SendsError(f"the call record holds {len(data)} numbers, not triples")
    third = len(data) // 3
    calls, at_us = [], 0
    for step, size, us in zip(data[:third], data[third : 2 * third], data[2 * third :], strict=True):
        at_us += step
        calls.append(Call(at_us / 1e6, size, us / 1e6))
    return calls
