"""Whether requests come slowly enough for the light-load fast paths (a moving average of the gaps).

At light load a request's few milliseconds between processes are most of what it spends outside
the GPU, so the express copies hurry them (``batchwire.transport.express``). Under load requests
wait for a busy worker anyway and batches form meanwhile: hurrying changes nothing there and would
only cost CPU on every request, so the gateway stops copying and the batcher reads less often.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class LightLoad:
    def __init__(self, max_rps: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_rps = max_rps
        self.clock = clock
        self._last = float("-inf")
        self._gap_s = float("inf")

    def arrived(self, count: int = 1) -> bool:
        """Notes ``count`` requests that came together; True while the moving rate stays at or under ``max_rps``."""
        now = self.clock()
        gap = min(now - self._last, 1.0) / max(1, count)
        self._last = now
        self._gap_s = gap if self._gap_s == float("inf") else 0.9 * self._gap_s + 0.1 * gap
        return self._gap_s * self.max_rps >= 1.0
