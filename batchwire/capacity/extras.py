"""A run's measured calls, handed to the simulated ones one by one in the order the run made them.

Each simulated call takes the extra time (beyond the curve) of the measured call after the one the
call before it took, kept within ``SLACK_S`` of its own start on the window's clock. Calls that a
stall slowed together in the run slow the simulated calls made at the same time, in the same order;
each measured call is taken about once, so long ones are not favoured, as they would be if each call
took the measured call that started nearest it (a long call leaves the longest gap before the next).
A call outside the record (the warm-up's, which the bench does not record) draws any of them.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence

SLACK_S = 0.1
"""How far from a simulated call's start the measured call whose extra it takes may have started."""


class MeasuredExtras:
    def __init__(self, extras_ms: Sequence[tuple[float, float]], rng: random.Random) -> None:
        """``extras_ms``: each measured call's start (seconds from the window's) and its extra, by start."""
        if not extras_ms:
            raise ValueError("no measured calls")
        self._starts = [at for at, _ in extras_ms]
        self._extras_s = [extra / 1000.0 for _, extra in extras_ms]
        self._next = 0
        self._rng = rng

    def take(self, at_s: float) -> float:
        """The extra, in seconds, of the call that starts ``at_s`` after the window's start."""
        starts = self._starts
        if not starts[0] - SLACK_S <= at_s <= starts[-1] + SLACK_S:
            return self._rng.choice(self._extras_s)
        low = bisect.bisect_left(starts, at_s - SLACK_S)
        high = bisect.bisect_right(starts, at_s + SLACK_S) - 1
        if high < low:  # none near (a gap in the record): the nearest, the one after or the one before
            low = high = low if starts[low] - at_s < at_s - starts[low - 1] else low - 1
        taken = min(max(self._next, low), high)
        self._next = taken + 1
        return self._extras_s[taken]
