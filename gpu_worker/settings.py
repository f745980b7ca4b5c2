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

    def __post_init__(self) -> None:
        if self.credit_ttl_s <= 0.5:
            raise ValueError(f"credit_ttl_s must be above 0.5 s, got {self.credit_ttl_s} (BATCHWIRE_CREDIT_TTL_S)")
