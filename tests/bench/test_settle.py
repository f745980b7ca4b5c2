"""A window that opens on the warm-up's backlog is told apart from one that opens settled."""

from __future__ import annotations

from batchwire.bench.loadgen import Tally
from batchwire.bench.settle import Backlog, means_by_second, opening_backlog


def test_a_backlog_draining_into_the_window_is_flagged() -> None:
    # Latency falls from 620 ms to a level of ~200 ms over the window's first ten seconds.
    draining = [620.0, 590.0, 540.0, 500.0, 450.0, 400.0, 340.0, 290.0, 240.0, 210.0] + [200.0, 195.0] * 10
    assert opening_backlog(draining) == Backlog(opening_ms=605.0, settled_ms=195.0)


def test_a_settled_window_with_a_late_spike_is_not_flagged() -> None:
    settled = [190.0, 205.0, 198.0, 260.0, 201.0, 199.0, 350.0, 202.0, 197.0, 200.0]
    assert opening_backlog(settled) is None


def test_a_fast_service_jitter_is_not_a_backlog() -> None:
    # 3x the level, but only by a few milliseconds.
    assert opening_backlog([6.0, 5.5, 2.0, 2.1, 1.9, 2.0, 2.0, 2.1]) is None


def test_short_windows_and_empty_seconds_are_not_judged() -> None:
    assert opening_backlog([600.0, 200.0, 200.0, 200.0]) is None, "too short to tell a trend from noise"
    assert opening_backlog([None, None, 200.0, 200.0, 200.0, 200.0]) is None, "no answer in the opening seconds"
    assert opening_backlog([600.0, 600.0, 200.0, None, None, None]) is None, "no answer in the second half"


def test_the_tally_keeps_each_seconds_mean_latency() -> None:
    tally = Tally()
    for second, latency_s in [(0, 0.3), (0, 0.1), (2, 0.05)]:
        tally.add_to_second(second, latency_s)
    assert means_by_second(tally.second_sums_s, tally.second_counts) == [200.0, None, 50.0]
