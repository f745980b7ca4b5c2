"""When a busy worker's batch is sealed: late enough to keep the workers' calls spread, and, when it
came up short, late enough for the requests on their way.

A busy worker offers its next credit before its call ends (``credit_lead_ms``), so the batch can
travel while the GPU finishes; the claim is the earliest moment to seal it, not always the best.
Two rules move the seal later, and only for a busy worker (an idle one is never kept waiting):

- **Spacing** (``batcher.spacing``): a call that would start less than L/k after another busy
  worker's is moved to start L/k after; the worker idles once for the difference.
- **Filling**: a batch holding less than half of the model's last one waits for more, until it has
  half or until ``fill_margin_ms`` before the worker's call can start. Under load a batch comes up
  short when the requests' records arrive late and together: over Kafka a record can be read once
  the partition's followers have it, and a follower that lags holds back everything after it. Sealed
  at the claim, the worker would run a small batch while those requests wait a whole call for the
  next one, GPU time lost where the load is highest. The wait ends before the call can start, less
  the batch's way there, so the worker does not idle for it.

A batch that fills up ends either wait at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Callable, Mapping

from prometheus_client import Histogram

from batcher.policy import BatchFormer
from batcher.spacing import Spacing
from schemas.records import Credit, InferenceRequest
from telemetry import metrics


class LateSeal:
    """Per model: the busy workers' last starts (spacing) and the size of the last batch (filling)."""

    def __init__(
        self,
        former: BatchFormer[InferenceRequest],
        wakes: Mapping[str, asyncio.Event],
        clock: Callable[[], float],
        *,
        spacing_margin_ms: float,
        fill_margin_ms: float,
    ) -> None:
        self.former = former
        self.wakes = wakes
        """Each model's event, set when its requests arrive or its batch is sealed by a timer."""
        self.clock = clock
        self.spacing_margin_s = spacing_margin_ms / 1000.0
        self.fill_margin_s = fill_margin_ms / 1000.0
        self._spacing: defaultdict[str, Spacing] = defaultdict(Spacing)
        self._last_size: dict[str, int] = {}

    async def wait(self, model: str, credit: Credit, starts_in_s: float) -> None:
        """Returns when the batch for ``credit``'s worker, free in ``starts_in_s``, should be sealed."""
        if starts_in_s <= 0:
            return
        start_s = self.clock() + starts_in_s
        if self.spacing_margin_s >= 0:
            due_s = self._spacing[model].due_s(credit.worker_id, start_s, credit.busy_ms / 1000.0)
            if due_s > start_s:
                await self._until(model, due_s - self.spacing_margin_s, metrics.SPACING_WAIT, lambda: False)
        if self.fill_margin_s >= 0:
            half = self._last_size.get(model, 0) // 2

            def enough() -> bool:
                return self.former.held(model) >= half

            await self._until(model, start_s - self.fill_margin_s, metrics.FILL_WAIT, enough)

    def sent(self, model: str, worker: str, start_s: float, call_s: float, size: int) -> None:
        """Records a batch of ``size`` sent to ``worker``, whose call starts at ``start_s``."""
        self._spacing[model].started(worker, start_s, call_s)
        self._last_size[model] = size

    async def _until(self, model: str, until_s: float, waited: Histogram, enough: Callable[[], bool]) -> None:
        if until_s <= self.clock() or enough():
            return
        waited.labels(model=model).observe(until_s - self.clock())
        wake = self.wakes[model]
        while not self.former.sealed(model) and not enough() and (left_s := until_s - self.clock()) > 0:
            wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left_s):
                    await wake.wait()
