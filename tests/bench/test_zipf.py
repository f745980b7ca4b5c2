"""``--zipf``: inputs from a fixed set, the k-th most popular drawn with probability proportional to 1 / k**s."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from batchwire.bench.zipf import Zipf, ZipfInputs


def test_inputs_repeat_with_zipf_popularity() -> None:
    zipf = Zipf(1000, 1.1)
    inputs = ZipfInputs(zipf, 32, random.Random(7), nonce="z")
    drawn = Counter(inputs.next()[0] for _ in range(20_000))
    assert len(drawn) <= 1000, "only the set's inputs are drawn"
    norm = sum(1 / k**1.1 for k in range(1, 1001))
    top_count = drawn.most_common(1)[0][1]
    assert abs(top_count / 20_000 - 1 / norm) < 0.02, f"the top input's share is {top_count / 20_000:.3f}"
    second = drawn.most_common(2)[1][1]
    assert 1.6 < top_count / second < 2.8, "rank 1 over rank 2 is about 2**1.1"


def test_each_body_carries_its_input() -> None:
    inputs = ZipfInputs(Zipf(5, 1.0), 16, random.Random(1), field="text")
    for _ in range(50):
        text, body = inputs.next()
        assert json.loads(body) == {"text": text} and len(text) == 16


@pytest.mark.parametrize("text", ["1000", "0:1.1", "10:0", "x:1", "10:y", ":"])
def test_a_bad_zipf_spec_says_the_form(text: str) -> None:
    with pytest.raises(ValueError, match="DISTINCT:S"):
        Zipf.parse(text)


def test_a_good_spec_parses() -> None:
    assert Zipf.parse("1000:1.1") == Zipf(1000, 1.1)
