"""Typed settings of the batcher role: the one source of their defaults (the CLI's flags read them)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from batcher.policy import FlushPolicy
from batcher.tiers import DEFAULT_MIN_SHARE, TierShares


def _batcher_id() -> str:
    return f"batcher-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, slots=True)
class BatcherSettings:
    batcher_id: str = field(default_factory=_batcher_id)
    policy: FlushPolicy = field(default_factory=FlushPolicy.work_conserving)
    fetch_max_records: int = 1000
    fetch_timeout_s: float = 0.2
    claim_timeout_s: float = 1.0
    max_held: int = 50_000
    """Requests held in memory (pending + sealed) above which the batcher stops reading."""
    send_retry_s: float = 0.2
    retry_max_s: float = 2.0
    """Longest pause between tries while Kafka or Redis is unreachable."""
    models: tuple[str, ...] = ()
    """The served models; a request for another one fails at once (empty: take any model)."""
    request_partitions: int = 0
    """Partitions of the request topic (``transport.routing``). When this batcher owns all of a
    model's partitions, no other batcher can need that model's workers, so while it has nothing to
    send it keeps one idle worker's credit in hand: a request that arrives then goes out without
    the round trip of a claim. 0: unknown, never keep one."""
    keep_credit_s: float = 1.0
    """Longest time a kept credit is held before it goes back to the pool (0: keep none)."""
    spacing_margin_ms: float = 5.0
    """When this batcher owns all of a model's partitions, it keeps the busy workers' calls spread
    evenly (``batcher.spacing``), sealing a batch this long before its call should start, the time
    the batch takes to reach the worker. -1: do not space the workers."""
    tier_min_share: float = DEFAULT_MIN_SHARE
    """While a priority tier waits behind a higher one, it earns this share of every batch's slots
    (``batcher.tiers``): no tier starves. 0: strict priority."""
    read_pace_ms: float = 10.0
    """While every worker is busy, read the request topic at most this often, and catch up when a
    credit comes, before sealing (``batcher.read_pacing``): over Kafka each read is a fetch round
    trip. 0: read continuously (the embedded mode passes 0: a read there costs no round trip)."""

    def __post_init__(self) -> None:
        if not 0 <= self.read_pace_ms <= 1000:
            raise ValueError(
                f"read_pace_ms ({self.read_pace_ms}) must be within 0..1000 milliseconds (BATCHWIRE_READ_PACE_MS)"
            )
        if not 0 <= self.keep_credit_s <= 60:
            raise ValueError(
                f"keep_credit_s ({self.keep_credit_s}) must be within 0..60 seconds (BATCHWIRE_KEEP_CREDIT_S)"
            )
        TierShares(self.tier_min_share)  # its range check names the setting
        if self.max_held < self.policy.max_batch:
            raise ValueError(
                f"max_held ({self.max_held}) must be at least max_batch ({self.policy.max_batch}) (BATCHWIRE_MAX_HELD)"
            )
