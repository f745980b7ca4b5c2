"""What one simulated deployment is: a model's curve, its workers and batchers, and the service
settings that shape its dispatch, each defaulting to what the services use."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from batcher.policy import FlushPolicy
from batcher.settings import BatcherSettings
from batchwire.capacity.curve import Curve
from gpu_worker.settings import WorkerSettings


def _default(cls: Any, name: str) -> Any:
    """A settings dataclass's default, so the simulation starts from what the services use."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One deployment of one model: its curve, workers, policy and the service settings that shape dispatch."""

    curve: Curve
    workers: int
    policy: FlushPolicy
    credit_lead_ms: float = _default(WorkerSettings, "credit_lead_ms")
    credit_lead_full_ms: float = _default(WorkerSettings, "credit_lead_full_ms")
    spacing_margin_ms: float = _default(BatcherSettings, "spacing_margin_ms")
    """-1: no spacing. Only a batcher alone with the model's workers spaces them, as in the service."""
    fill_margin_ms: float = _default(BatcherSettings, "fill_margin_ms")
    """-1: a busy worker's short batch is sealed at once (``batcher.late_seal``); alone, as spacing."""
    batchers: int = 1
    """Batchers that share the model's requests (round robin) and its workers' credits."""
    transit_ms: float = 0.0
    """A batch's way from the batcher to its worker."""
    overhead_ms: float = 0.0
    """Added to every request's latency: the gateway's and the result's hops."""
    contention_ms: float = 0.0
    """Mean of a further delay drawn per batch from an exponential distribution: the hops' queueing for
    CPU shared with other processes, which delays a whole batch's answers at once (0: none)."""
    seed: int = 0
    """Seed of the contention delays (the arrivals have their own)."""
    worker_scale: tuple[float, ...] = ()
    """Per-worker multiplier of the curve's latency, by worker index (missing: 1): a slower GPU."""
    call_extra_ms: float = 0.0
    """Added to every call whatever its size (its steps' wait for the GIL), drawn per call from an
    exponential distribution with this mean if ``call_extra_spread``."""
    call_extra_spread: bool = False
    call_extras_ms: tuple[tuple[float, float], ...] = ()
    """Measured calls' ``(start, extra)``, the start in seconds from the measured window's, in place of
    ``call_extra_ms``: the calls take them one by one (``batchwire.capacity.extras``), so a stall that
    slowed calls in the run slows the simulated ones at the same time."""
    per_item_ms: float = 0.0
    """Added per answer ahead in its batch: a batch's results are stored and answered one after another."""
    timeout_s: float = math.inf
    """A request's deadline after its arrival (inf: none)."""
    max_backlog: int = 0
    """Stop, reporting unstable, once this many requests are held (0: 50 full batches per worker)."""
    record: bool = False
    """Keep every batch's record (tests check the invariants on them)."""

    def __post_init__(self) -> None:
        if self.workers < 1 or self.batchers < 1:
            raise ValueError(f"workers and batchers must be at least 1, got {self.workers} and {self.batchers}")
        if min(self.contention_ms, self.overhead_ms, self.call_extra_ms) < 0:
            raise ValueError(f"overhead, contention and call extra must be >= 0 ms, got {self}")
        if len(self.worker_scale) > self.workers or any(scale <= 0 for scale in self.worker_scale):
            raise ValueError(f"worker_scale takes at most one positive factor per worker, got {self.worker_scale}")

    def scale(self, worker: int) -> float:
        """Worker ``worker``'s latency multiplier."""
        return self.worker_scale[worker] if worker < len(self.worker_scale) else 1.0

    @property
    def backlog_limit(self) -> int:
        return self.max_backlog or max(10_000, 50 * self.workers * self.batch_limit)

    @property
    def batch_limit(self) -> int:
        """The largest batch a worker runs: the policy's, cut by the backend's (the curve's largest size)."""
        return min(self.policy.max_batch, self.curve.max_batch)
