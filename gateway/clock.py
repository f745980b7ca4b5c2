"""Time as the gateway reads it, injectable so tests can pin timestamps and ages."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never jumps: for ages and latencies."""
        ...

    def wall_ms(self) -> int:
        """Epoch milliseconds: for timestamps other processes read (``deadline_ms``)."""
        ...


class SystemClock:
    """The real clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall_ms(self) -> int:
        return time.time_ns() // 1_000_000
