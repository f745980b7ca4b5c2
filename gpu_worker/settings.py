"""Typed settings of the GPU worker role (filled from flags and BATCHWIRE_* variables by the CLI)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def _worker_id() -> str:
    return f"worker-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    worker_id: str = field(default_factory=_worker_id)
    model: str = "sim"
    credit_ttl_s: float = 5.0
    """An unclaimed credit is re-offered this often, so a credit lost with a dead batcher heals."""
    poll_timeout_s: float = 0.5
    batch_log: str | None = None
    """Append one JSON line per batch run (ids, sizes, monotonic start/end) to this file."""
    max_deliveries: int = 3
    """An input in flight alone at this many worker deaths goes to the dead-letter topic."""
    hang_factor: float = 10.0
    """A backend call running past this many times its expected latency is hung (0: never)."""
    hang_min_s: float = 5.0
    """The hang limit is never shorter than this."""
    expected_latency_ms: float | None = None
    """Expected duration of one backend call; None: the moving average of recent calls."""
    credit_lead_ms: float = 15.0
    """Offer the next credit this long before the running call is expected to end (0: when it ends),
    so the next batch is formed and travels while the GPU finishes."""
    credit_lead_full_ms: float = 40.0
    """The lead while the running batch holds at least half of the backend's max batch. Then the GPU
    is the bottleneck and the hand-over is slowest (the process is busy): a batch that comes late
    idles the GPU, and the requests that miss it would have waited for a worker anyway. At light
    load a long lead would seal batches early for nothing, so ``credit_lead_ms`` applies."""
    drain_timeout_s: float = 30.0
    """On shutdown or a rebalance, how long the batches in hand may take before they are handed back
    uncommitted."""
    retry_max_s: float = 2.0
    """Longest pause between tries while Kafka or Redis is unreachable."""
    max_output_bytes: int = 1_048_576
    """A task whose output is longer (UTF-8) fails with ``output_too_large`` instead of being stored (0: no limit)."""
    deterministic: bool = False
    """The model's answer depends on the input alone: duplicate inputs within one batch run once."""

    def __post_init__(self) -> None:
        if self.credit_ttl_s <= 0.5:
            raise ValueError(f"credit_ttl_s must be above 0.5 s, got {self.credit_ttl_s} (BATCHWIRE_CREDIT_TTL_S)")
        if self.max_deliveries < 1:
            raise ValueError(f"max_deliveries must be at least 1, got {self.max_deliveries} (BATCHWIRE_MAX_DELIVERIES)")
        if self.hang_factor < 0 or self.hang_min_s <= 0:
            raise ValueError(
                f"hang_factor must be >= 0 (0: off) and hang_min_s > 0, got {self.hang_factor} and {self.hang_min_s} "
                "(BATCHWIRE_HANG_FACTOR, BATCHWIRE_HANG_MIN_S)"
            )
        if self.credit_lead_ms < 0 or self.credit_lead_full_ms < 0:
            raise ValueError(
                f"credit_lead_ms and credit_lead_full_ms must be >= 0 (0: off), got {self.credit_lead_ms} and "
                f"{self.credit_lead_full_ms} (BATCHWIRE_CREDIT_LEAD_MS, BATCHWIRE_CREDIT_LEAD_FULL_MS)"
            )
        if self.max_output_bytes < 0:
            raise ValueError(
                f"max_output_bytes must be >= 0 (0: no limit), got {self.max_output_bytes} (BATCHWIRE_MAX_OUTPUT_BYTES)"
            )
        if self.drain_timeout_s < 0:
            raise ValueError(
                f"drain_timeout_s must be >= 0 (0: hand the batch in hand back at once), got {self.drain_timeout_s} "
                "(BATCHWIRE_DRAIN_TIMEOUT_S)"
            )
        if self.expected_latency_ms is not None and self.expected_latency_ms <= 0:
            raise ValueError(
                f"expected_latency_ms must be positive, got {self.expected_latency_ms} (BATCHWIRE_EXPECTED_LATENCY_MS)"
            )

    @property
    def refresh_margin_s(self) -> float:
        """An unclaimed credit is replaced this long before it expires."""
        return min(1.0, self.credit_ttl_s / 2)
