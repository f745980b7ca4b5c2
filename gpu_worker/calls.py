"""Backend calls for one group of inputs: up-front rejections, then bisection around failing inputs.

Each call runs on the backend's own thread (``runner.BackendRunner``); a plain exception splits the
inputs in halves until the failing ones are alone, so the healthy ones still get answers. A hung
call is not an input's failure: ``BackendHung`` goes up to the worker, which gives the batch back.
"""

from __future__ import annotations

import time

from batchwire import metrics
from gpu_worker.backends.base import Backend, InputError
from gpu_worker.runner import BackendHung, BackendRunner


class Failure:
    """Why one input got no output."""

    __slots__ = ("code", "message")

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message


class BackendCalls:
    def __init__(self, backend: Backend, runner: BackendRunner, model: str, worker_id: str) -> None:
        self.backend = backend
        self.runner = runner
        self.model = model
        self.worker_id = worker_id

    async def run(self, inputs: list[str]) -> dict[int, str | Failure]:
        """Outputs (or failures) by input index."""
        results: dict[int, str | Failure] = {}
        rejected: dict[int, InputError] = self.backend.input_errors(inputs)
        for index, err in rejected.items():
            results[index] = Failure(err.code, str(err))
        todo = [index for index in range(len(inputs)) if index not in rejected]
        if todo:
            await self._bisect(inputs, todo, results)
        return results

    async def _bisect(self, inputs: list[str], indices: list[int], results: dict[int, str | Failure]) -> None:
        try:
            outputs = await self._call([inputs[i] for i in indices])
        except BackendHung:
            raise
        except Exception as err:
            if len(indices) == 1:
                results[indices[0]] = Failure("backend_error", f"the model failed on this input: {err}")
                return
            middle = len(indices) // 2
            await self._bisect(inputs, indices[:middle], results)
            await self._bisect(inputs, indices[middle:], results)
            return
        for index, output in zip(indices, outputs, strict=True):
            results[index] = output

    async def _call(self, inputs: list[str]) -> list[str]:
        start = time.perf_counter()
        try:
            outputs = await self.runner.call(self.backend.batchstring, inputs)
        finally:
            elapsed = time.perf_counter() - start
            metrics.BACKEND_CALL.labels(model=self.model, backend=self.backend.name).observe(elapsed)
            metrics.WORKER_BUSY.labels(worker=self.worker_id).inc(elapsed)
        if len(outputs) != len(inputs):
            raise RuntimeError(f"backend returned {len(outputs)} outputs for {len(inputs)} inputs")
        return outputs
