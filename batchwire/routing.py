"""Which request-topic partitions carry which model (partition affinity).

Configured models split the partitions into disjoint contiguous ranges, so one model's flood never
shares a partition (and so a batcher's backlog) with another model's traffic. The gateway and the
batchers derive the same ranges from the same model list.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Sequence


class Partitioner:
    def __init__(self, models: Sequence[str], partitions: int) -> None:
        if partitions < 1:
            raise ValueError("the request topic needs at least one partition")
        self.models = tuple(models)
        self.partitions = partitions
        self._ranges: dict[str, range] = {}
        if self.models:
            share = max(1, partitions // len(self.models))
            for index, model in enumerate(self.models):
                start = (index * share) % partitions
                self._ranges[model] = range(start, min(start + share, partitions))
        self._counter = itertools.count()

    def partitions_for(self, model: str) -> range:
        found = self._ranges.get(model)
        if found is not None:
            return found
        return range(zlib.crc32(model.encode()) % self.partitions, zlib.crc32(model.encode()) % self.partitions + 1)

    def choose(self, model: str) -> int:
        """Spreads one model's requests round-robin over its own partitions."""
        candidates = self.partitions_for(model)
        return candidates[next(self._counter) % len(candidates)]
