"""A clock the test moves by hand, for code that takes its time source as a callable."""

from __future__ import annotations


class FakeClock:
    """Returns ``now`` (seconds) when called; only ``advance`` moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
