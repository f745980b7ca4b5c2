"""Which request offsets may be committed: only those below every request not yet handed over."""

from __future__ import annotations

from collections import deque


class OffsetTracker:
    """Per partition, the offsets read and not yet finished, in read order.

    A request is *finished* once its batch is durably with a worker (or it expired, or failed to
    decode). The commit point of a partition is the lowest unfinished offset, or one past the last
    read offset when everything is finished, so a crash re-reads exactly the unfinished ones.
    """

    def __init__(self) -> None:
        self._open: dict[int, deque[int]] = {}
        self._done: dict[int, set[int]] = {}
        self._next: dict[int, int] = {}
        self._committed: dict[int, int] = {}

    def read(self, partition: int, offset: int) -> None:
        self._open.setdefault(partition, deque()).append(offset)
        self._next[partition] = offset + 1

    def finish(self, partition: int, offset: int) -> None:
        if partition in self._open:
            self._done.setdefault(partition, set()).add(offset)

    def committable(self) -> dict[int, int]:
        """Offsets to commit now (only partitions whose commit point moved since the last call)."""
        out: dict[int, int] = {}
        for partition, open_offsets in self._open.items():
            done = self._done.get(partition, set())
            while open_offsets and open_offsets[0] in done:
                done.discard(open_offsets.popleft())
            point = open_offsets[0] if open_offsets else self._next[partition]
            if self._committed.get(partition) != point:
                out[partition] = point
        return out

    def committed(self, offsets: dict[int, int]) -> None:
        self._committed.update(offsets)

    def forget(self, partitions: frozenset[int]) -> None:
        for partition in partitions:
            self._open.pop(partition, None)
            self._done.pop(partition, None)
            self._next.pop(partition, None)
            self._committed.pop(partition, None)

    def unfinished(self) -> int:
        return sum(len(offsets) for offsets in self._open.values())
