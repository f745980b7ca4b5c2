"""Priority tiers in batch forming: which held items one batch takes. Pure code, no clock, no I/O.

A batch takes higher tiers first (rank 0, ``high``, before rank 1, ``normal``, before rank 2,
``low``), each tier in arrival order. So that no tier starves, a lower tier *earns* slots while it
waits behind a higher one: ``min_share`` of every batch's slots, carried from batch to batch until
it takes them. The guarantee: while a tier's items wait behind a higher tier, every run of batches
with ``S`` slots in all gives it at least ``floor(S * min_share) - 1`` of them, whatever the higher
tiers send (the one is a fraction carried over, or a slot that batches of one or two items give to
the other lower tier first); so even with batches of one it is never passed over for long. A tier
that waits behind nothing earns nothing: it takes whatever is left anyway.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

TIERS = 3
"""Ranks 0 (high), 1 (normal) and 2 (low): ``schemas.records.Priority.rank``."""

DEFAULT_MIN_SHARE = 0.1


class TierShares:
    """One model's earned slots per tier, and the split of each batch between the tiers."""

    __slots__ = ("_earned", "min_share")

    def __init__(self, min_share: float = DEFAULT_MIN_SHARE) -> None:
        if not 0 <= min_share <= 1 / TIERS:
            raise ValueError(
                f"tier_min_share must be within 0..{1 / TIERS:.3f}, got {min_share} (BATCHWIRE_TIER_MIN_SHARE)"
            )
        self.min_share = min_share
        self._earned = [0.0] * TIERS

    def split(self, waiting: Sequence[int], slots: int) -> list[int]:
        """How many items of each tier (by rank) a batch of up to ``slots`` takes from ``waiting``.

        First each waiting lower tier's earned slots, then the rest by rank. The result is
        recorded: what a tier takes is spent from what it earned.
        """
        quota = [0] * TIERS
        above = False
        for rank in range(TIERS):
            if waiting[rank] and above:
                self._earned[rank] += slots * self.min_share
                quota[rank] = min(waiting[rank], math.floor(self._earned[rank] + 1e-9))
            else:
                self._earned[rank] = 0.0
            above = above or waiting[rank] > 0
        left = slots - sum(quota)
        if left < 0:  # earned more than one batch holds: the lowest tiers wait for the next one
            for rank in reversed(range(TIERS)):
                cut = min(quota[rank], -left)
                quota[rank] -= cut
                left += cut
        for rank in range(TIERS):
            extra = min(left, waiting[rank] - quota[rank])
            quota[rank] += extra
            left -= extra
        for rank in range(TIERS):
            rest = max(0.0, self._earned[rank] - quota[rank])
            # A tier that took all it had waiting was not held back: it banks no more than a slot.
            self._earned[rank] = min(rest, 1.0) if quota[rank] == waiting[rank] else rest
        return quota


def ranks_waiting(ranks: Sequence[int]) -> list[int]:
    """How many of ``ranks`` are of each tier."""
    waiting = [0] * TIERS
    for rank in ranks:
        waiting[rank] += 1
    return waiting
