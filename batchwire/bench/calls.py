"""The record of a rate's backend calls: each call's batch size and how long it ran.

A backend that computes on the machine's CPU runs longer under load than when profiled alone, and by
how much varies from call to call with what else wants the cores. The simulation draws each call's
extra time from these records (``batchwire validate-sim``), where a mean alone would have to guess
the spread. The bench reads them from the workers' batch journal (``--batch-log``, whose times are
the system's monotonic clock, the same in every process), and stores them in ``results.json`` the
way it stores the sends (``batchwire.bench.sends``): first every call's size, then its duration in
microseconds.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from pathlib import Path

from batchwire.bench.sends import SendsError, pack, unpack


def read(journal: Path, start_s: float, end_s: float) -> list[tuple[int, float]]:
    """``(size, duration_s)`` of every first delivery's successful call that started in
    ``[start_s, end_s)`` (monotonic seconds); none when the journal is missing."""
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
        if call.get("outcome") == "ok" and call.get("delivery", 1) == 1 and start_s <= call["start"] < end_s:
            calls.append((int(call["size"]), float(call["end"]) - float(call["start"])))
    return calls


def encode(calls: Sequence[tuple[int, float]]) -> str:
    """``(size, duration_s)`` pairs, compact."""
    sizes = array("i", (size for size, _ in calls))
    return pack(sizes + array("i", (round(seconds * 1e6) for _, seconds in calls)))


def decode(text: str) -> list[tuple[int, float]]:
    """The pairs ``encode`` was given (durations to the microsecond)."""
    data = unpack(text, "call record")
    if len(data) % 2:
        raise SendsError(f"the call record holds {len(data)} numbers, not pairs")
    half = len(data) // 2
    return [(size, us / 1e6) for size, us in zip(data[:half], data[half:], strict=True)]
