"""The simulated GPU: a fixed latency per call whatever the batch size, answers the reversed input.

For fault tests it can also hang forever (``hang_on``) or kill its process (``crash_on``, like a
segfaulting CUDA kernel) on a batch that holds an input containing a given substring.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

from gpu_worker.backends.base import BackendError, BatchSizeError, InputError

CRASH_EXIT_CODE = 70
"""Exit status of a process the sim backend crashed on purpose (``crash_on``)."""


class ReentryError(BackendError):
    """``batchstring`` was entered while a call was running: the one-call-at-a-time rule broke."""


class SimBackend:
    """Sleeps ``latency_ms`` per call (like a GPU kernel that takes as long for 1 input as for 100)."""

    name = "sim"

    def __init__(
        self,
        latency_ms: float = 100.0,
        max_batch: int = 100,
        *,
        hang_on: str | None = None,
        crash_on: str | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.latency_ms = latency_ms
        self.max_batch = max_batch
        self.hang_on = hang_on or None
        self.crash_on = crash_on or None
        self._busy = threading.Lock()
        self._never = threading.Event()

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
            if self.crash_on is not None and any(self.crash_on in text for text in inputs):
                os._exit(CRASH_EXIT_CODE)  # a native crash: no exception, no cleanup, no log line
            if self.hang_on is not None and any(self.hang_on in text for text in inputs):
                self._never.wait()  # a kernel that never returns
            time.sleep(self.latency_ms / 1000.0)
            return [text[::-1] for text in inputs]
        finally:
            self._busy.release()

    def close(self) -> None:
        return None
