"""Whether a rate's window opened with the service still working off its warm-up.

A service that starts cold (connections, consumer groups, a broker's JIT) may fall behind in its
first second of load. Near capacity such a backlog drains only at the spare capacity, 1 / (1 - load)
times slower than it built: at 95 % of capacity a one-second hiccup takes some twenty seconds to
clear. A window that opens before it has cleared measures the start-up, not the rate, and its p99 is
that backlog's. Each second's mean latency shows it: high at the window's start, falling to a level.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

OPENING_S = 2
"""The window's first seconds, compared with its second half."""
MIN_WINDOW_S = 6
"""Windows shorter than this are not judged: their halves are too short to tell a trend from noise."""
RATIO = 1.3
"""The opening seconds' mean latency over the second half's median per second that flags a backlog..."""
MIN_EXCESS_MS = 20.0
"""...and by at least this much, so that a fast service's millisecond jitter is not flagged."""


@dataclass(frozen=True, slots=True)
class Backlog:
    """The window's opening seconds against its settled level (mean latencies, ms)."""

    opening_ms: float
    settled_ms: float


def means_by_second(sums_s: Sequence[float], counts: Sequence[int]) -> list[float | None]:
    """Mean latency (ms) of the answers due in each second of the window (None: no answer)."""
    return [round(total * 1000.0 / count, 2) if count else None for total, count in zip(sums_s, counts, strict=True)]


def opening_backlog(by_second_ms: Sequence[float | None]) -> Backlog | None:
    """The opening backlog, if the window's first seconds ran well above its second half; else None."""
    if len(by_second_ms) < MIN_WINDOW_S:
        return None
    opening = [v for v in by_second_ms[:OPENING_S] if v is not None]
    settled = [v for v in by_second_ms[len(by_second_ms) // 2 :] if v is not None]
    if not opening or not settled:
        return None
    opening_ms, settled_ms = statistics.fmean(opening), statistics.median(settled)
    if opening_ms > RATIO * settled_ms and opening_ms - settled_ms >= MIN_EXCESS_MS:
        return Backlog(round(opening_ms, 1), round(settled_ms, 1))
    return None
