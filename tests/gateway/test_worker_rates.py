"""The rates workers state in their credits, summed per model: what admission predicts waits by
before a model's drain rate is measured."""

from __future__ import annotations

import pytest

from gateway.admission.worker_rates import Stated, WorkerRates
from schemas.records import Credit


def credit(worker: str, *, issued_ms: int = 0, ttl_ms: int = 5_000, max_batch: int = 5, busy_ms: int = 100) -> Credit:
    return Credit(worker, "a", 0, 1, issued_ms, issued_ms + ttl_ms, max_batch=max_batch, busy_ms=busy_ms)


def test_the_model_drains_at_most_the_sum_of_its_workers_full_batches_per_call() -> None:
    rates = WorkerRates()
    rates.seen("a", [credit("w1"), credit("w2", max_batch=10, busy_ms=200)])
    assert rates.stated("a", 1_000) == Stated(pytest.approx(50 + 50), 0.2)
    assert rates.stated("b", 1_000) is None, "a model whose credits were never read has no rate"


def test_a_workers_latest_credit_counts_once_and_is_kept_until_it_expires() -> None:
    """A credit shows only while unclaimed: the one read before stands until its expiry."""
    rates = WorkerRates()
    rates.seen("a", [credit("w1", busy_ms=100), credit("w2")])
    rates.seen("a", [credit("w1", issued_ms=1_000, busy_ms=200)])  # w2's credit is claimed meanwhile
    assert rates.stated("a", 2_000) == Stated(pytest.approx(25 + 50), 0.2)
    assert rates.stated("a", 5_000) == Stated(pytest.approx(25), 0.2), "w2 is gone: its credit expired"
    assert rates.stated("a", 6_000) is None


def test_a_worker_that_has_not_run_a_call_leaves_the_rate_unknown() -> None:
    """A partial sum would refuse what the model can answer, so none is given."""
    rates = WorkerRates()
    rates.seen("a", [credit("w1"), credit("fresh", busy_ms=0)])
    assert rates.stated("a", 1_000) is None
    rates.seen("b", [credit("unlimited", max_batch=0)])
    assert rates.stated("b", 1_000) is None
