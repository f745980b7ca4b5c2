"""Matches express copies of requests with their Kafka records: pure bookkeeping, no I/O.

A request can reach the batcher twice: as an express copy (Redis, usually first) and as its Kafka
record. The copy may be batched before its record comes; what must hold anyway:

* each request is batched once, whichever of the two comes first;
* its Kafka offset is committed only after the batch holding it is on Kafka: while the copy is
  held, the record's offset is tracked as read and not finished, like any held request's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from enum import Enum
from typing import Generic, TypeVar

from batcher.policy import Pending

Item = TypeVar("Item")


class Record(Enum):
    NEW = "new"
    """No copy came first: batch it as usual."""
    HELD = "held"
    """Its copy is held: the copy now carries the record's offset (track it as read)."""
    DONE = "done"
    """Its copy was handed over or ended: the record is finished at once."""


class ExpressLedger(Generic[Item]):
    """Per request id: a held copy, a copy that is done, or a record that came first."""

    def __init__(self, remember: int = 10_000) -> None:
        self.remember = remember
        self._held: dict[str, Pending[Item]] = {}
        self._done: OrderedDict[str, None] = OrderedDict()
        self._recorded: OrderedDict[str, None] = OrderedDict()

    def copy(self, task_id: str, pending: Pending[Item]) -> bool:
        """A copy came; False when its record came first (drop the copy), else it is held."""
        if task_id in self._recorded or task_id in self._held or task_id in self._done:
            return False
        self._held[task_id] = pending
        return True

    def record(self, task_id: str, partition: int, offset: int) -> Record:
        """A Kafka record came: what the batcher does with it."""
        held = self._held.pop(task_id, None)
        if held is not None:
            held.partition, held.offset, held.awaiting_record = partition, offset, False
            return Record.HELD
        if task_id in self._done:
            del self._done[task_id]
            return Record.DONE
        self._bounded(self._recorded, task_id)
        return Record.NEW

    def finished(self, task_id: str) -> None:
        """A copy was handed over (its batch is on Kafka) or ended: its record is done when it comes."""
        if self._held.pop(task_id, None) is not None:
            self._bounded(self._done, task_id)

    def drop(self, partitions: Iterable[int]) -> None:
        """Forgets copies held for partitions this batcher lost (their new owner reads the records)."""
        lost = frozenset(partitions)
        for task_id in [t for t, p in self._held.items() if p.partition in lost]:
            del self._held[task_id]

    def _bounded(self, ids: OrderedDict[str, None], task_id: str) -> None:
        ids[task_id] = None
        if len(ids) > self.remember:
            ids.popitem(last=False)
