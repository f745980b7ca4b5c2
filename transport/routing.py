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
    def __init__(self, models: Sequence[str], partitions: int, *, run: int = 1) -> None:
        """``run``: how many consecutive requests of a model go to the same partition (see ``choose``)."""
        if partitions < 1:
            raise ValueError("the request topic needs at least one partition")
        if run < 1:
            raise ValueError("a partition run is at least one request")
        self.models = tuple(models)
        self.partitions = partitions
        self.run = run
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
        """Spreads one model's requests round-robin over its own partitions, ``run`` at a time.

        Runs longer than one let a Kafka producer that lingers (``linger_ms``) put requests that
        come together in one record batch: one partition's records travel as a batch, and a
        producer sends a batch per partition, so one request per partition in turn defeats it.
        """
        candidates = self.partitions_for(model)
        return candidates[(next(self._counter) // self.run) % len(candidates)]
