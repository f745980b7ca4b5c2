"""What one simulated run produced: every served request's latency, each batch, and the counters
behind the summary (``batchwire.capacity.simulate.summarize``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class BatchRecord:
    worker: int
    sent_s: float
    start_s: float
    end_s: float
    items: tuple[int, ...]


@dataclass(slots=True)
class SimOutcome:
    """What one run produced: every served request's latency, and the counters behind the summary."""

    arrivals: int
    horizon_s: float
    latencies_s: list[float] = field(default_factory=list)
    ends_s: list[float] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    batches: int = 0
    expired: int = 0
    busy_s: float = 0.0
    last_end_s: float = 0.0
    queue_sum: int = 0
    queue_max: int = 0
    stopped_s: float | None = None
    """When the run stopped early because the backlog passed its limit (over capacity)."""
    records: list[BatchRecord] = field(default_factory=list)
