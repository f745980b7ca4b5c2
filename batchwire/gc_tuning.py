"""Python's cyclic garbage collector, set for a server that must answer in steady time.

A full collection holds the GIL throughout, so under load the backend thread's return and every
hand-over wait for it: calls end late and the tail grows. Start-up's objects (modules, the app,
settings) are never garbage yet are scanned by every full collection, so they are frozen; and the
young generation is collected every 20,000 net allocations instead of 700 (objects that die young
are freed by reference counting and never counted). Cycles are still collected, less often. The
figures are in docs/performance.md ("Garbage collection").
"""

from __future__ import annotations

import gc

Threshold = tuple[int, int, int]

DEFAULT: Threshold = (20_000, 20, 100)


def parse_threshold(text: str) -> Threshold | None:
    """``"young,middle,full"`` as for ``gc.set_threshold``, or ``off`` to keep Python's own."""
    if text.strip().lower() == "off":
        return None
    parts = text.split(",")
    try:
        values = tuple(int(part) for part in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or values[0] < 1 or min(values) < 0:
        raise ValueError(f"a GC threshold is three counts like 20000,20,100 (or off), got {text!r}")
    return values[0], values[1], values[2]


def tune_gc(threshold: Threshold | None) -> None:
    """Freezes what exists now (call it once start-up has built the process's long-lived objects)
    and sets the collector's thresholds; ``None`` leaves the collector as Python set it."""
    if threshold is None:
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(*threshold)
