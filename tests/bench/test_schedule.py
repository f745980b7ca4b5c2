"""The Poisson schedule and the request inputs (pure, no network)."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from batchwire.bench.schedule import InputFactory, poisson_offsets


def test_mean_rate_matches_the_offered_rate() -> None:
    offsets = poisson_offsets(1000.0, 20.0, random.Random(7))
    achieved = len(offsets) / 20.0
    # 20000 expected arrivals: the Poisson standard deviation is ~141, so 3% is over 4 sigma.
    assert achieved == pytest.approx(1000.0, rel=0.03), f"expected ~1000 req/s, got {achieved:.1f}"
    assert offsets == sorted(offsets)
    assert offsets[0] > 0
    assert offsets[-1] < 20.0


def test_gaps_are_exponential() -> None:
    offsets = poisson_offsets(500.0, 40.0, random.Random(11))
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets, strict=False)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 500, rel=0.05)
    # An exponential has standard deviation equal to its mean (a fixed interval would give 0) ...
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, abs=0.08)
    # ... and P(gap > t) = exp(-t / mean) at every t, checked at a few points.
    for multiple in (0.5, 1.0, 2.0, 3.0):
        share = sum(gap > multiple * mean for gap in gaps) / len(gaps)
        assert share == pytest.approx(math.exp(-multiple), abs=0.02), f"P(gap > {multiple} mean) = {share:.3f}"


def test_same_seed_same_schedule() -> None:
    assert poisson_offsets(300, 2, random.Random(3)) == poisson_offsets(300, 2, random.Random(3))
    assert poisson_offsets(300, 2, random.Random(3)) != poisson_offsets(300, 2, random.Random(4))


def test_bad_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="rate must be above 0"):
        poisson_offsets(0, 1, random.Random())


def test_inputs_are_unique_sized_and_carried_in_valid_json() -> None:
    factory = InputFactory(40, random.Random(1), field="prompt", nonce="ab")
    made = [factory.next() for _ in range(5000)]
    texts = [text for text, _ in made]
    assert len(set(texts)) == len(texts), "inputs must be unique per request"
    assert all(len(text) == 40 for text in texts)
    for text, body in made[:50]:
        assert json.loads(body) == {"prompt": text}


def test_short_size_still_gives_unique_inputs() -> None:
    factory = InputFactory(0, random.Random(1))
    texts = {factory.next()[0] for _ in range(1000)}
    assert len(texts) == 1000
