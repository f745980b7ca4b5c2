"""Typed settings of the batcher role: the one source of their defaults (the CLI's flags read them)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from batcher.policy import FlushPolicy
from batcher.tiers import DEFAULT_MIN_SHARE, TierShares
from schemas.codec import BATCH_FIXED_BYTES, MAX_RECORD_BYTES


def _batcher_id() -> str:
    return f"batcher-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, slots=True)
class BatcherSettings:
    batcher_id: str = field(default_factory=_batcher_id)
    policy: FlushPolicy = field(default_factory=FlushPolicy.work_conserving)
    fetch_max_records: int = 1000
    fetch_timeout_s: float = 0.2
    claim_timeout_s: float = 1.0
    max_batch_bytes: int = MAX_RECORD_BYTES - BATCH_FIXED_BYTES
    """Bytes a batch's items take together at most (``schemas.codec.item_bytes``): a batch is one record
    on the batch topic, which refuses a longer one every time it is sent."""
    max_held: int = 50_000
    """Requests held in memory (pending + sealed) above which the batcher stops reading."""
    send_retry_s: float = 0.2
    retry_max_s: float = 2.0
    """Longest pause between tries while Kafka or Redis is unreachable."""
    models: tuple[str, ...] = ()
    """The served models; a request for another one fails at once (empty: take any model)."""
    request_partitions: int = 0
    """Partitions of the request topic (``transport.routing``). When this batcher owns all of a
    model's partitions, no other batcher sends to that model's workers, so it may space their calls
    (``spacing_margin_ms``). 0: unknown, never space."""
    spacing_margin_ms: float = 5.0
    """When this batcher owns all of a model's partitions, it keeps the busy workers' calls spread
    evenly (``batcher.scheduler.Spacing``), sealing a batch this long before its call should start, the time
    the batch takes to reach the worker. -1: do not space the workers."""
    tier_min_share: float = DEFAULT_MIN_SHARE
    """While a priority tier waits behind a higher one, it earns this share of every batch's slots
    (``batcher.tiers``): no tier starves. 0: strict priority."""

    def __post_init__(self) -> None:
        TierShares(self.tier_min_share)  # its range check names the setting
        if self.max_held < self.policy.max_batch:
            raise ValueError(
                f"--max-batch (BATCHWIRE_MAX_BATCH) is {self.policy.max_batch}; a batch holds at most the "
                f"{self.max_held} requests a batcher holds in memory"
            )
