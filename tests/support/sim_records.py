"""Credits and requests for the ``sim`` model, as the batcher tests offer and send them."""

from __future__ import annotations

import time

from schemas.records import Credit, InferenceRequest

PARTITIONS = 4
"""Request partitions of the batcher tests' bus."""


def credit(worker: str, partition: int, ttl_ms: int = 60_000) -> Credit:
    """``worker``'s credit for one batch of up to 100 on ``partition``, valid ``ttl_ms``."""
    now = int(time.time() * 1000)
    return Credit(worker, "sim", partition, 1, now, now + ttl_ms, max_batch=100)


def request(task_id: str) -> InferenceRequest:
    """A ``sim`` request due in 30 s, replying to gateway ``gw``."""
    now = int(time.time() * 1000)
    return InferenceRequest(task_id, "sim", "x", now, now + 30_000, "gw")
