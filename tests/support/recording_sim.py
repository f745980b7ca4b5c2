"""The sim backend, remembering every input it was handed: tests count what reached the GPU."""

from __future__ import annotations

import threading

from gpu_worker.backends.sim import SimBackend


class RecordingSim(SimBackend):
    """The sim backend, remembering every input it was handed."""

    def __init__(self, latency_ms: float) -> None:
        super().__init__(latency_ms=latency_ms)
        self.inputs: list[str] = []
        self._lock = threading.Lock()

    def batchstring(self, inputs: list[str]) -> list[str]:
        with self._lock:
            self.inputs.extend(inputs)
        return super().batchstring(inputs)
