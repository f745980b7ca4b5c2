"""The simulated GPU: a fixed latency per call whatever the batch size, answers the reversed input."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from gpu_worker.backends.base import BackendError, BatchSizeError, InputError


class ReentryError(BackendError):
    """``batchstring`` was entered while a call was running: the one-call-at-a-time rule broke."""


class SimBackend:
    """Sleeps ``latency_ms`` per call (like a GPU kernel that takes as long for 1 input as for 100)."""

    name = "sim"

    def __init__(self, latency_ms: float = 100.0, max_batch: int = 100) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.latency_ms = latency_ms
        self.max_batch = max_batch
        self._busy = threading.Lock()

    def load(self) -> None:
        return None

    def input_errors(self, inputs: Sequence[str]) -> dict[int, InputError]:
        return {}

    def batchstring(self, inputs: list[str]) -> list[str]:
        if not inputs or len(inputs) > self.max_batch:
            raise BatchSizeError(f"batchstring takes 1 to {self.max_batch} inputs, got {len(inputs)}")
        if not self._busy.acquire(blocking=False):
            raise ReentryError("batchstring entered twice at once: a GPU runs one call at a time")
        try:
            time.sleep(self.latency_ms / 1000.0)
            return [text[::-1] for text in inputs]
        finally:
            self._busy.release()

    def close(self) -> None:
        return None
