"""Which share of a model's queue waits ahead of a request of each priority tier, from the recent
mix of tiers this gateway admitted: the wait admission predicts for a tier counts only that share,
since batches take higher tiers first (``batcher.tiers``)."""

from __future__ import annotations

from schemas.records import Priority

WINDOW = 1000
"""Admissions after which older ones count half: the mix follows a change within a few windows."""


class TierMix:
    """Per model, decayed counts of admitted requests by tier."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._counts: dict[str, list[float]] = {}

    def admitted(self, model: str, tier: Priority) -> None:
        counts = self._counts.get(model)
        if counts is None:
            counts = self._counts[model] = [0.0] * len(Priority)
        counts[tier.rank] += 1
        if sum(counts) >= 2 * self.window:
            counts[:] = [count / 2 for count in counts]

    def ahead(self, model: str, tier: Priority) -> float:
        """The share (0..1] of ``model``'s queue a request of ``tier`` waits behind; 1 while unknown."""
        counts = self._counts.get(model)
        total = sum(counts) if counts is not None else 0.0
        if counts is None or total == 0:
            return 1.0
        return max(sum(counts[: tier.rank + 1]) / total, 1 / self.window)
