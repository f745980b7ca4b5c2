"""The embedded mode's result cache: completed answers in a dict, each expiring after its TTL.

Bounded by entry count and, with ``max_bytes``, by the bytes its entries hold, least recently used
first out, so a flood of distinct inputs cannot grow the process without end; an evicted answer is
simply computed again. An answer larger than the whole byte bound is not kept. Each put also drops
the expired entries at the least recently used end, so the memory a burst took falls back as new
answers come, without the old ones being read again.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_MAX_ENTRIES = 100_000

ENTRY_BYTES = 200
"""What one entry costs beyond its key and output strings: its record, expiry float and dict slots."""


def entry_bytes(key: str, output: str) -> int:
    """The memory one entry holds (its strings counted as Python keeps them)."""
    return ENTRY_BYTES + sys.getsizeof(key) + sys.getsizeof(output)


@dataclass(slots=True)
class _Entry:
    expires_s: float
    output: str
    size: int


class MemoryResultCache:
    """``ResultCache`` in memory: ``get`` is a dict look-up, an entry past its TTL reads as a miss."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        *,
        max_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``max_bytes``: what the entries may hold (None: no byte bound). ``clock`` is monotonic seconds
        (injected so tests move time instead of sleeping)."""
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive (None: no byte bound), got {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held_bytes(self) -> int:
        """What the entries hold, by this cache's count."""
        return self._bytes

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        self._entries.clear()
        self._bytes = 0

    async def get(self, key: str) -> str | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_s <= self._clock():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return entry.output

    async def put(self, key: str, output: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            return
        if key in self._entries:
            self._drop(key)  # a later answer replaces the earlier, kept or not
        size = entry_bytes(key, output)
        if self.max_bytes is not None and size > self.max_bytes:
            return
        now = self._clock()
        self._entries[key] = _Entry(now + ttl_s, output, size)
        self._bytes += size
        self._shrink(now)

    def _shrink(self, now: float) -> None:
        """Drops from the least recently used end: expired entries, then any past the bounds."""
        max_bytes = self.max_bytes if self.max_bytes is not None else sys.maxsize
        while self._entries:
            key, oldest = next(iter(self._entries.items()))
            if oldest.expires_s > now and len(self._entries) <= self.max_entries and self._bytes <= max_bytes:
                return
            self._drop(key)

    def _drop(self, key: str) -> None:
        self._bytes -= self._entries.pop(key).size
