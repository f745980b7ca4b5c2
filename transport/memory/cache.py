"""The embedded mode's result cache: completed answers in a dict, each expiring after its TTL.

Bounded by entry count, least recently used first out, so a flood of distinct inputs cannot grow
the process without end; an evicted answer is simply computed again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

DEFAULT_MAX_ENTRIES = 100_000


class MemoryResultCache:
    """``ResultCache`` in memory: ``get`` is a dict look-up, an entry past its TTL reads as a miss."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock`` is monotonic seconds (injected so tests move time instead of sleeping)."""
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self._max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        self._entries.clear()

    async def get(self, key: str) -> str | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires_s, output = entry
        if expires_s <= self._clock():
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return output

    async def put(self, key: str, output: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            return
        self._entries[key] = (self._clock() + ttl_s, output)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
