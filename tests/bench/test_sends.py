"""The send record's codec: what the bench writes, the simulation reads back to the microsecond."""

from __future__ import annotations

import pytest

from batchwire.bench import sends


def test_a_record_decodes_to_its_sends_to_the_microsecond() -> None:
    pairs = [(0.000512, 0.0), (0.0011, 0.0000031), (0.25, 0.0804), (0.2500004, 0.0799996)]
    back = sends.decode(sends.encode(pairs))
    assert len(back) == len(pairs)
    for (due, lag), (due_back, lag_back) in zip(pairs, back, strict=True):
        assert due_back == pytest.approx(due, abs=1e-6) and lag_back == pytest.approx(lag, abs=1e-6)
    assert sends.decode(sends.encode([])) == []


def test_a_large_record_stays_small() -> None:
    pairs = [(i * 0.000625, 0.0002 if i % 7 else 0.001) for i in range(32_000)]
    text = sends.encode(pairs)
    assert len(text) < 80_000, f"32,000 sends took {len(text)} characters"
    assert sends.decode(text)[-1] == pytest.approx(pairs[-1], abs=1e-6)


@pytest.mark.parametrize("text", ["not base64!", "aGVsbG8=", ""])
def test_a_damaged_record_is_refused_by_name(text: str) -> None:
    with pytest.raises(sends.SendsError, match="send record"):
        sends.decode(text)


def test_a_warm_ups_sends_due_before_the_window_round_trip() -> None:
    warmup = [(-3.0, 0.0), (-2.999_5, 0.004), (-0.000_001, 0.0)]
    assert sends.decode(sends.encode(warmup)) == warmup, "microseconds, exactly"
