"""The embedded mode's fleet: each role's last heartbeat in a dict."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from schemas.heartbeat import Beat


class MemoryFleet:
    """``Fleet`` in memory; ``clock`` is wall milliseconds, as a beat's ``at_ms`` is."""

    def __init__(self, clock: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        self._clock = clock
        self._beats: dict[str, Beat] = {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def beat(self, beats: Sequence[Beat]) -> None:
        for beat in beats:
            self._beats[beat.key] = beat

    async def members(self) -> list[Beat]:
        now_ms = self._clock()
        for key in [key for key, beat in self._beats.items() if beat.forgotten(now_ms)]:
            del self._beats[key]
        return list(self._beats.values())
