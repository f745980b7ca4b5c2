"""Clocks the test moves by hand, for code that takes its time source as an argument."""

from __future__ import annotations


class FakeClock:
    """Returns ``now`` (seconds) when called; only ``advance`` moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FixedClock:
    """A clock for code that reads ``monotonic()`` and ``wall_ms()``; tests set ``mono`` and ``wall``."""

    def __init__(self) -> None:
        self.wall = 1_700_000_000_000
        self.mono = 100.0

    def monotonic(self) -> float:
        return self.mono

    def wall_ms(self) -> int:
        return self.wall
